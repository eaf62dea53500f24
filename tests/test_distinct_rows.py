"""Equal pooled vectors score bit-identically, and a fold with no signal stays at the probe's cold start: the two
ways the batched and per-fit D1 paths disagreed on make run's P2_first cells (distinct_rows, batched_logistic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolbench.prober.auroc import auroc
from poolbench.prober.batched_logistic import fit_many, shared_gram
from poolbench.prober.distinct_rows import _distinct, distinct_by_hash, score_distinct_rows, score_distinct_rows_np
from poolbench.prober.newton_logistic import NewtonLogisticProbe
from poolbench.prober.probes import DiffMeanProbe


def _position_rounded(rows: torch.Tensor) -> torch.Tensor:
    """A score that, like a GEMM's tiles, rounds a row by where it sits: 1e-9 per position on top of its sum."""
    return rows.sum(dim=1) + 1e-9 * torch.arange(rows.shape[0], dtype=rows.dtype)


def test_equal_rows_get_one_score_wherever_they_sit():
    X = torch.tensor([[1.0, 2.0], [0.5, 0.5], [1.0, 2.0], [3.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    s = score_distinct_rows(_position_rounded, X)
    assert s[0] == s[2] and s[1] == s[4]
    assert len(set(s.tolist())) == 3  # distinct rows keep distinct scores
    # Without the gathering the pair (0, 2) is ordered by position and AUROC counts it: 0.0 instead of 0.5.
    y = np.array([1, 0, 0, 1, 1])
    assert auroc(_position_rounded(X)[[0, 2]].numpy(), y[[0, 2]]) == 0.0
    assert auroc(s[[0, 2]].numpy(), y[[0, 2]]) == 0.5
    s_np = score_distinct_rows_np(lambda r: _position_rounded(torch.from_numpy(r)).numpy(), X.numpy())
    np.testing.assert_array_equal(s_np, s.numpy())


def test_all_distinct_rows_are_scored_as_given():
    X = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    np.testing.assert_array_equal(score_distinct_rows(_position_rounded, X), _position_rounded(X))


def test_the_probes_give_equal_rows_equal_scores():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 40))
    X = base[rng.integers(0, 6, size=60)]
    y = np.tile([1, 0], 30)
    for probe in (NewtonLogisticProbe(), DiffMeanProbe()):
        s = probe.fit(X, y).decision_function(X)
        for row in base:
            same = np.all(row == X, axis=1)
            assert np.unique(s[same]).size <= 1


def _no_signal_fold() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows with a signal overall, and a fold of 8 rows where every vector appears once with each label: that
    fold's optimum is coef 0, intercept 0 (every score tied, AUROC 0.5 on any rows)."""
    rng = np.random.default_rng(3)
    base = rng.normal(size=(4, 30))
    X_fold = np.repeat(base, 2, axis=0)
    y_fold = np.tile([1, 0], 4)
    X_rest = rng.normal(size=(24, 30))
    y_rest = np.tile([1, 0], 12)
    X_rest[y_rest == 1, :5] += 1.5
    return np.r_[X_fold, X_rest], np.r_[y_fold, y_rest], np.arange(8), np.arange(8, 32)


def test_a_fold_without_signal_stays_at_the_cold_start_when_warm_started():
    X, y, fold, rest = _no_signal_fold()
    Xt = torch.as_tensor(X)
    gram = shared_gram(Xt)
    full = fit_many(Xt, [np.arange(len(y))], [y], gram=gram)
    assert float(full.v.abs().max()) > 1e-3  # the warm start is far from the fold's optimum
    fit = fit_many(Xt, [fold], [y[fold]], gram=gram, init=full)
    ref = NewtonLogisticProbe().fit(X[fold], y[fold])
    assert np.all(ref.coef_ == 0) and ref.intercept_ == 0.0
    scores = fit.scores(Xt)[0].numpy()
    assert np.all(scores == 0.0)  # a stop near 0 would leave ~1e-6 scores that AUROC orders
    assert auroc(scores[rest], y[rest]) == 0.5
    assert int(fit.iterations[0]) == 0


def test_small_fits_take_own_grams_else_the_shared_one(monkeypatch):
    """fit_many picks exact Newton (each fit's own Gram) where that is cheap (make run's 36-row cells), and where
    a fit's own Gram fails its Cholesky (a column almost constant in the fold) the shared Gram's path instead."""
    from poolbench.prober import batched_logistic

    X, y, _, _ = _no_signal_fold()
    rows = [np.arange(24), np.arange(8, 32)]
    Xt = torch.as_tensor(X)
    assert batched_logistic.exact_is_cheaper(32, 24)
    assert not batched_logistic.exact_is_cheaper(1400, 1120)
    chosen = fit_many(Xt, rows, [y[r] for r in rows])
    exact = fit_many(Xt, rows, [y[r] for r in rows], exact=True)
    torch.testing.assert_close(chosen.v, exact.v, rtol=0, atol=0)
    original = batched_logistic._fit

    def own_grams_fail(*args):
        if args[6]:  # exact
            raise torch.linalg.LinAlgError("linalg.cholesky: not positive-definite")
        return original(*args)

    monkeypatch.setattr(batched_logistic, "_fit", own_grams_fail)
    fallen = fit_many(Xt, rows, [y[r] for r in rows])
    shared = original(Xt[None], rows, [y[r] for r in rows], 1.0, 1e-6, 200, False, None, None).cell(0)
    torch.testing.assert_close(fallen.v, shared.v, rtol=0, atol=0)


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two inverse maps group the rows alike: each group of one is exactly a group of the other."""
    pairs = set(zip(a.tolist(), b.tolist(), strict=True))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_row_hashes_group_rows_as_torch_unique_does(dtype):
    """The GPU's distinct rows (distinct_by_hash) against torch.unique(dim=0), here on the CPU: the same groups,
    -0.0 and 0.0 one value, every row its group's values."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(40, 300, generator=gen).to(dtype)
    base[5, :7] = 0.0
    base[6] = base[5]
    base[6, :7] = -0.0  # equal to row 5 as values, other bits
    X = base[torch.randint(0, 40, (500,), generator=gen)]
    distinct, inverse = distinct_by_hash(X)
    ref, ref_inverse = torch.unique(X, dim=0, return_inverse=True)
    assert distinct.shape == ref.shape == (39, 300)  # 40 bases, two of them equal
    assert _same_partition(inverse, ref_inverse)
    assert torch.equal(distinct.index_select(0, inverse), X)
    assert distinct_by_hash(base[:5]) is None  # every row distinct: score X as given


def test_a_hash_collision_of_unequal_rows_falls_back_to_the_exact_grouping(monkeypatch):
    from poolbench.prober import distinct_rows

    X = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [5.0, 6.0]], dtype=torch.float64)
    monkeypatch.setattr(distinct_rows, "row_hashes", lambda rows: torch.zeros(rows.shape[0], dtype=torch.int64))
    distinct, inverse = distinct_by_hash(X)  # one hash for all: only the check can tell the rows apart
    assert distinct.shape == (3, 2) and _same_partition(inverse, torch.tensor([0, 1, 0, 2]))
    monkeypatch.setattr(distinct_rows, "row_hashes", lambda rows: torch.tensor([0, 0, 1, 2]))
    assert distinct_by_hash(X[[0, 1, 3]]) is None  # a collision among all-distinct rows: still none to gather


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_distinct_rows_on_cuda_group_as_the_cpu_does():
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(30, 4096, generator=gen, dtype=torch.float64)[torch.randint(0, 30, (1400,), generator=gen)]
    on_gpu = _distinct(X.cuda())
    on_cpu = _distinct(X)
    assert on_gpu is not None and on_cpu is not None
    assert _same_partition(on_gpu[1].cpu(), on_cpu[1])
    s = score_distinct_rows(lambda rows: rows @ torch.ones(4096, device="cuda", dtype=rows.dtype), X.cuda()).cpu()
    for k in range(30):
        assert s[on_cpu[1] == k].unique().numel() == 1
