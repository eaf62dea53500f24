"""A layer's D1 cells probed together (batched_d1_cells, batched_logistic's leading cell dimension): each cell's
records as it gets them alone, one fit call for all cells where one cell takes one, and a handful of torch ops a
cell where one cell a call takes ~15,000 (on a GPU each op is a launch and a slice of host time:
bench/measured/h100_session20)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_batched_logistic import _bound
from torch.utils._python_dispatch import TorchDispatchMode

from poolbench.corpus.passage import Passage
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.prober import batched_logistic, concept_probe
from poolbench.prober.batched_cell import batched_d1_cell, batched_d1_cells
from poolbench.prober.concept_probe import probe_pooled_cells
from poolbench.prober.newton_logistic import NewtonLogisticProbe

STRATEGIES = ("A1_mean", "A2_max", "P1_last", "W1_first_k")


def _layer(d: int = 24, pairs: int = 40, seed: int = 6):
    """One layer's pooled table, four strategies over the same passages (matched pairs, three lexical types), each
    with the concept on its own feature at its own strength."""
    items = [Passage(f"{split}-{i}-{label}", "t", label, f"d{i % 3}", 4, f"{split}-{i}", split, "c")
             for split, n in (("train", pairs), ("test", pairs // 2)) for i in range(n) for label in (1, 0)]
    rng = np.random.default_rng(seed)
    y = np.array([p.label for p in items])
    vectors = rng.normal(size=(1, len(STRATEGIES), len(items), d)) * rng.uniform(0.5, 2.0, size=d)
    for s in range(len(STRATEGIES)):
        vectors[0, s, :, s] += (0.6 + 0.4 * s) * y
    builder = PooledTableBuilder(items, d)
    builder.add(vectors, [3], list(STRATEGIES), [p.id for p in items], np.zeros((len(STRATEGIES), len(items)), bool))
    return builder.table(), {p.id: p.domain for p in items}


class _Ops(TorchDispatchMode):
    """Counts the torch ops dispatched (on a GPU: each a kernel launch or a host-side op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _probe(monkeypatch, per_call: int):
    table, types = _layer()
    monkeypatch.setattr(concept_probe, "cells_per_call", lambda _device: per_call)
    monkeypatch.setitem(batched_logistic.FIT_COUNTER, "calls", 0)
    monkeypatch.setitem(batched_logistic.FIT_COUNTER, "fits", 0)
    ops = _Ops()
    with ops:
        records, scores = probe_pooled_cells(table, "c", n_folds=5, n_bootstrap=20, types=types)
    return records, scores, ops.count, dict(batched_logistic.FIT_COUNTER)


@pytest.mark.numerics  # MDL's 1e-7 (float64 bits, test_batched_logistic's figure) held under every kernel profile
def test_a_layers_cells_probed_together_keep_each_cells_records(monkeypatch):
    alone, alone_scores, _, _ = _probe(monkeypatch, 1)
    together, together_scores, _, _ = _probe(monkeypatch, len(STRATEGIES))
    assert [(r.strategy, r.probe) for r in together] == [(r.strategy, r.probe) for r in alone]
    for a, t in zip(alone, together, strict=True):
        # rank statistics: equal unless two scores of a cell fall within the stopping rule's bound (none here)
        for field in ("cv_auroc", "test_auroc", "ci_low", "ci_high", "seed_cv_aurocs", "selectivity",
                      "control_cv_auroc", "mdl_block_ends"):
            assert getattr(t, field) == getattr(a, field), (a.strategy, a.probe, field)
        if a.probe == "logistic":  # MDL bits move by at most n·|a|·Δz/ln 2 (test_batched_logistic's figure)
            assert t.mdl_compression == pytest.approx(a.mdl_compression, abs=1e-7)
    table, _ = _layer()
    view = concept_probe.PooledTableView(table)
    for s, strategy in enumerate(STRATEGIES):  # held-out logistic scores within the stopping rule's bound
        cell = view.matrix(3, strategy)
        train, test = cell.subset("train"), cell.subset("test")
        bound = _bound(NewtonLogisticProbe().fit(train.X, train.y), test.X, test.y)
        gap = np.abs(_heldout(together_scores, strategy) - _heldout(alone_scores, strategy))
        assert gap.size == len(test.y) and (gap <= bound).all(), s


def _heldout(scores, strategy: str) -> np.ndarray:
    """A score table's held-out logistic scores of one strategy's cell."""
    column = lambda name: scores.column(name).to_numpy(zero_copy_only=False)  # noqa: E731
    keep = (column("strategy") == strategy) & (column("probe") == "logistic") & (column("kind") == "heldout")
    return column("score")[keep]


def test_cells_probed_together_take_one_fit_call_where_one_cell_takes_one_and_a_fifth_of_the_ops(monkeypatch):
    _, _, ops_alone, fits_alone = _probe(monkeypatch, 1)
    _, _, ops_together, fits_together = _probe(monkeypatch, len(STRATEGIES))
    cells = len(STRATEGIES)
    assert fits_together["fits"] == fits_alone["fits"]  # the same fits
    assert fits_together["calls"] * cells == fits_alone["calls"]  # in one call where each cell took one
    # one cell a call dispatches ~15,000 torch ops (mostly the Newton loop's); four together share one loop
    assert ops_together < 0.4 * ops_alone, (ops_together, ops_alone)


def test_cells_that_differ_in_their_rows_or_width_are_never_batched_together(monkeypatch):
    table, types = _layer()
    calls = []
    real = concept_probe.batched_d1_cells

    def spy(X_trains, *args, **kwargs):
        calls.append(len(X_trains))
        return real(X_trains, *args, **kwargs)

    monkeypatch.setattr(concept_probe, "cells_per_call", lambda _device: 8)
    monkeypatch.setattr(concept_probe, "batched_d1_cells", spy)
    probe_pooled_cells(table, "c", n_folds=5, n_bootstrap=20, types=types, reliability=False)
    assert calls == [len(STRATEGIES)]
    calls.clear()
    monkeypatch.setattr(concept_probe, "cells_per_call", lambda _device: 3)
    probe_pooled_cells(table, "c", n_folds=5, n_bootstrap=20, types=types, reliability=False)
    assert calls == [3, 1]  # at most cells_per_call at once
    X, y = np.ones((4, 3)), np.array([1, 0, 1, 0])
    g = np.array([0, 0, 1, 1])
    with pytest.raises(concept_probe.ProbeError, match="differ in width"):
        batched_d1_cells([X, np.ones((4, 5))], y, g, [X, np.ones((4, 5))], y, g, n_folds=2, reliability=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cells_batched_on_cuda_equal_each_cell_alone_on_the_cpu():
    table, types = _layer()
    view = concept_probe.PooledTableView(table)
    cells = [view.matrix(3, s) for s in STRATEGIES]
    trains, tests = [c.subset("train") for c in cells], [c.subset("test") for c in cells]
    kinds = np.array([types[str(p)] for p in trains[0].passage_ids])
    gpu = batched_d1_cells([t.X for t in trains], trains[0].y, trains[0].groups, [t.X for t in tests], tests[0].y,
                           tests[0].groups, n_bootstrap=20, types_train=kinds, device=torch.device("cuda"))
    for (result, stats), train, test in zip(gpu, trains, tests, strict=True):
        ref, ref_stats = batched_d1_cell(train.X, train.y, train.groups, test.X, test.y, test.groups, n_bootstrap=20,
                                         types_train=kinds, device=torch.device("cpu"))
        for name in ref.probes:
            assert result[name].to_record() == ref[name].to_record(), name
        assert stats["seed_cv_aurocs"] == ref_stats["seed_cv_aurocs"]
        assert stats["mdl_compression"] == pytest.approx(ref_stats["mdl_compression"], abs=1e-7)


def _matrices(cells: int = 4, n: int = 200, d: int = 256):
    """Float32 train rows of `cells` cells (a pooled table's dtype) over one set of pairs."""
    rng = np.random.default_rng(3)
    y = np.tile([1, 0], n // 2)
    return [rng.normal(size=(n, d)).astype(np.float32) + y[:, None] * 0.3 for _ in range(cells)], y, \
        np.repeat(np.arange(n // 2), 2)


def test_a_batch_of_cells_widens_its_rows_once_into_the_stack_and_holds_each_cells_numbers():
    """Several cells go to the fits as one float64 [B, n, d] tensor built slot by slot from their float32 rows, where
    each cell's rows were first widened on the host (a float64 copy), those copies stacked (another) and the stack
    sent: on a GPU most of a layer task's seconds (bench/measured/h100_session30). The numbers are the same to the
    bit; restoring the host copies fails the allocation bound below."""
    import tracemalloc

    from poolbench.prober.batched_cell import _stacked
    from poolbench.prober.d1 import check_split

    Xs, y, groups = _matrices()
    cpu = torch.device("cpu")
    stacked = _stacked(Xs, cpu)
    assert stacked.dtype == torch.float64
    assert torch.equal(stacked, torch.as_tensor(np.stack([X.astype(np.float64) for X in Xs])))
    one = np.ones((3, 2))
    assert _stacked([one], cpu).data_ptr() == torch.as_tensor(one).data_ptr()  # one CPU cell: a view, no copy
    kept, _, _ = check_split("train", Xs[0], y, groups, float64=False)
    assert kept is Xs[0]  # checked in its own dtype, not copied
    bad = Xs[0].copy()
    bad[5, 7] = np.nan
    with pytest.raises(concept_probe.ProbeError, match="train split: 1 of 200 passages have NaN/inf"):
        check_split("train", bad, y, groups, float64=False)
    assert check_split("train", np.ones((4, 2), int), np.array([1, 0, 1, 0]), np.arange(4),
                       float64=False)[0].dtype == np.float64  # integers are widened as before
    wide_bytes = sum(X.size for X in Xs) * 8
    tracemalloc.start()
    try:
        batched_d1_cells(Xs, y, groups, Xs, y, groups, n_folds=2, n_bootstrap=5, reliability=False, device=cpu)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the host's numpy arrays: scores and one cell's DiffMean on a CPU (a quarter), never the cells' float64 copies
    assert peak < 0.5 * wide_bytes, (peak, wide_bytes)
