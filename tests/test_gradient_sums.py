"""The gradient sums S2's backward keeps, on the tiny Llama: u . G equals d log p / d eps with eps * u added at every
position of the layer (an independent autograd pass through a steering hook), the norm sums give
mean_residual_norms' alpha unit, first-order steerability tracks the exact shift at small alpha, and the worker
stores the table beside each shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from negation_pairs import passages
from tolerances import assert_float32_close

from poolbench.extractor.hook_points import add_hooks
from poolbench.extractor.loading import LoadedModel, load_model
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.gradient_sums import gradient_arrays
from poolbench.pooler.registry import resolve_strategies
from poolbench.steerer.likelihood_shift import passage_log_likelihoods
from poolbench.steerer.measures import mean_residual_norms
from poolbench.steerer.steerability import (
    exact_steerability,
    first_order_steerability,
    gradient_projections,
    residual_norm_from_sums,
)

pytestmark = pytest.mark.numerics
LAYERS = [0, 1]


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def pooled(loaded):
    data = passages(4, "train") + passages(3, "test")
    out = pool_concept_tables(loaded, data, LAYERS, resolve_strategies(["A1_mean", "S2_gradient"]), batch_size=4,
                              max_length=64)
    return data, out


def directional_derivative(loaded: LoadedModel, text: str, layer: int, u: np.ndarray) -> float:
    """d log p(text) / d eps at eps = 0, eps * u added at every position of the layer: one scalar leaf."""
    enc = loaded.tokenizer([text], return_tensors="pt")
    eps = torch.zeros((), requires_grad=True)
    direction = torch.from_numpy(u.astype(np.float32))
    with torch.enable_grad(), add_hooks(loaded.decoder_layers, {f"layers.{layer}.out": lambda h: h + eps * direction}):
        logits = loaded.model(**enc).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, enc["input_ids"][0, 1:, None]).sum()
        (grad,) = torch.autograd.grad(logp, eps)
    return float(grad)


def test_gradient_sums_are_the_directional_derivative_of_the_passage_likelihood(loaded, pooled) -> None:
    data, out = pooled
    assert out.layer_gradients is not None and sorted(out.layer_gradients) == LAYERS
    u = np.random.default_rng(0).standard_normal(loaded.hidden_size)
    u /= np.linalg.norm(u)
    some = data[:3] + data[-3:]  # train and test passages, each alone (no padding) in the reference
    for layer in LAYERS:
        G, _, _ = gradient_arrays(out.layer_gradients[layer], [p.id for p in some])
        projections = gradient_projections(u, G)
        expected = [directional_derivative(loaded, p.text, layer, u) for p in some]
        # one backward through <= 2 layers of width 32 / MLP 64 over <= 10 tokens, then a d = 32 dot product
        assert_float32_close(projections, expected, terms=2 * (32 + 64 + 10) + 32,
                             scale=float(np.abs(G).max()) + 1.0, err_msg=f"layer {layer}")


def test_norm_sums_give_the_backends_alpha_unit(loaded, pooled) -> None:
    data, out = pooled
    for layer in LAYERS:
        _, sums, counts = gradient_arrays(out.layer_gradients[layer], [p.id for p in data])
        assert counts.sum() > 0
        expected = mean_residual_norms(loaded, [p.text for p in data], [layer], max_length=64)[layer]
        assert_float32_close(residual_norm_from_sums(sums, counts), expected, terms=32 + int(counts.sum()),
                             scale=float(sums.max()))


def test_first_order_steerability_tracks_the_exact_shift_at_small_alpha(loaded, pooled) -> None:
    """At alpha -> 0 the exact shift per unit alpha converges on the first-order measure (its error is O(alpha));
    should fail: the reversed vector's exact shift has the opposite sign."""
    data, out = pooled
    test = [p for p in data if p.split == "test"]
    texts, y = [p.text for p in test], np.array([p.label for p in test])
    layer = 1
    G, sums, counts = gradient_arrays(out.layer_gradients[layer], [p.id for p in test])
    r = residual_norm_from_sums(sums, counts)
    u = G[y == 1].mean(axis=0) - G[y == 0].mean(axis=0)
    u /= np.linalg.norm(u)  # the direction that steers most, so the first-order term dominates
    first = first_order_steerability(u, r, G, y)
    base = passage_log_likelihoods(loaded, texts, max_length=64)
    gaps = []
    for alpha in (1e-2, 1e-3):
        exact = exact_steerability(passage_log_likelihoods(loaded, texts, layer=layer, delta=alpha * r * u,
                                                           max_length=64), base, y, alpha)
        gaps.append(abs(exact - first))
    assert first > 0
    assert gaps[1] < 0.2 * gaps[0] + 1e-3 * abs(first)  # O(alpha): ten times smaller alpha, ~ten times smaller gap
    assert gaps[1] < 0.05 * abs(first)
    reversed_exact = exact_steerability(passage_log_likelihoods(loaded, texts, layer=layer, delta=-1e-3 * r * u,
                                                                max_length=64), base, y, 1e-3)
    assert reversed_exact < 0


def test_the_worker_stores_gradient_sums_beside_each_shard(tiny_llama_dir, tmp_path) -> None:
    from poolbench.pooler.gradient_sums import read_gradient_table
    from poolbench.pooler.worker import ExtractorWorker, PoolTask
    from poolbench.store.url import open_store

    url = f"file://{tmp_path}"
    worker = ExtractorWorker(str(tiny_llama_dir))
    data = passages(2, "train")
    task = PoolTask("negation", data, "pooled/x", {}, (0, 1))
    worker.pool_concepts([task], ["A1_mean"], store_url=url, batch_size=4, max_length=64)
    store = open_store(url)
    assert read_gradient_table(store, "pooled/x", 0) is None  # pooled without S2: nothing to keep
    worker.pool_concepts([task], ["A1_mean", "S2_gradient"], store_url=url, batch_size=4, max_length=64)
    table = read_gradient_table(store, "pooled/x", 1)
    assert table is not None and sorted(table.column("passage_id").to_pylist()) == sorted(p.id for p in data)


def test_the_steerability_section_reads_each_cell_at_its_chosen_layer(tiny_llama_dir, tmp_path) -> None:
    """Every (concept, strategy) at the layer its CV chose, S recomputed by hand from the stored tables, and
    Spearman with D1 per concept; a run without S2 has no section."""
    from scipy.stats import spearmanr

    from poolbench.driver.steerability_stage import steerability_section
    from poolbench.pooler.gradient_sums import read_gradient_table
    from poolbench.pooler.pooled_table import PooledTableView, read_pooled_layer
    from poolbench.pooler.worker import ExtractorWorker, PoolTask
    from poolbench.records.d1 import D1CellRecord
    from poolbench.store.url import open_store

    url = f"file://{tmp_path}"
    store = open_store(url)
    worker = ExtractorWorker(str(tiny_llama_dir))
    data = passages(4, "train") + passages(3, "test")
    strategies = ["A1_mean", "A4_norm_weighted", "P1_last", "S2_gradient"]
    worker.pool_concepts([PoolTask("negation", data, "pooled/n", {}, (0, 1))], strategies, store_url=url,
                         batch_size=4, max_length=64)
    d1 = {"A1_mean": 0.9, "A4_norm_weighted": 0.8, "P1_last": 0.7, "S2_gradient": 0.6}
    chosen = {"A1_mean": 0, "A4_norm_weighted": 1, "P1_last": 1, "S2_gradient": 0}
    records = [D1CellRecord(concept="negation", layer=layer, strategy=s, probe="logistic",
                            cv_auroc=0.9 if layer == chosen[s] else 0.6, test_auroc=d1[s], ci_low=0.5, ci_high=1.0)
               for s in strategies for layer in (0, 1)]
    section = steerability_section(store, {"negation": "pooled/n"}, records)
    assert section is not None
    cells = {c["strategy"]: c for c in section["cells"]}
    assert {s: c["layer"] for s, c in cells.items()} == chosen
    for s, layer in chosen.items():
        view = PooledTableView(read_pooled_layer(store, "pooled/n", layer))
        m = view.matrix(layer, s)
        train, test = m.split == "train", m.split == "test"
        v = m.X[train & (m.y == 1)].mean(0).astype(np.float64) - m.X[train & (m.y == 0)].mean(0)
        G, sums, counts = gradient_arrays(read_gradient_table(store, "pooled/n", layer), list(m.passage_ids))
        proj = G @ (v / np.linalg.norm(v))
        r = sums[train].sum() / counts[train].sum()
        expected = r * (proj[test & (m.y == 1)].mean() - proj[test & (m.y == 0)].mean())
        assert_float32_close(cells[s]["steerability"], expected, terms=32 + 8, scale=r * float(np.abs(proj).max()))
    rho = spearmanr([d1[s] for s in strategies], [cells[s]["steerability"] for s in strategies]).statistic
    assert section["agreement"]["per_concept"][0]["rho"] == pytest.approx(float(rho), abs=1e-12)
    worker.pool_concepts([PoolTask("negation", data, "pooled/plain", {}, (0, 1))], strategies[:3], store_url=url,
                         batch_size=4, max_length=64)
    assert steerability_section(store, {"negation": "pooled/plain"}, records) is None


def test_d2_alpha_unit_is_read_from_the_stored_norm_sums_without_a_forward(loaded, pooled) -> None:
    """Where a steering cell carries its layer's gradient table, alpha's unit is the stored train norm sums' mean:
    no residual-norm forward runs, and it is the very r_L first-order S uses (bit for bit); within float32 of the
    forward it replaces. A cell without the table still measures (should fail if the table were ignored: the
    counted forwards would not be empty)."""
    from poolbench.pooler.pooled_table import PooledTableView
    from poolbench.steerer.cell_steerability import cell_steerability
    from poolbench.steerer.run import AlphaUnits, CellInputs
    from poolbench.steerer.worker import SteeringWorker

    data, out = pooled
    worker = SteeringWorker(loaded)
    calls: list[list[int]] = []
    measure = worker.residual_norms
    worker.residual_norms = lambda t, layers: calls.append(list(layers)) or measure(t, layers)
    train_texts = [p.text for p in data if p.split == "train"]
    for layer in LAYERS:
        table, gradients = out.layers[layer], out.layer_gradients[layer]
        stored = CellInputs("negation", "A1_mean", layer, table, train_texts, gradient_table=gradients)
        unit = AlphaUnits(worker, [stored])(stored)
        assert calls == []
        steer = cell_steerability(PooledTableView(table), gradients, "negation", "A1_mean", layer)
        assert unit == steer.residual_norm
        measured = AlphaUnits(worker, [CellInputs("negation", "A1_mean", layer, table, train_texts)])
        forward = measured(CellInputs("negation", "A1_mean", layer, table, train_texts))
        assert calls == [[layer]]
        calls.clear()
        _, sums, counts = gradient_arrays(gradients, [p.id for p in data if p.split == "train"])
        assert_float32_close(unit, forward, terms=32 + int(counts.sum()), scale=float(sums.max()))


def test_a_bfloat16_layers_norm_sums_are_those_of_its_float32_cast_bit_for_bit() -> None:
    """GradientTee reduces a bfloat16 layer's token norms in float32 without a float32 copy of the states: the very
    values the norm of that copy gives (the cast is exact; the reduction runs the same float32 kernel), summed over
    the tokens alpha's unit is measured on (real, not special, not the first)."""
    from poolbench.extractor.padded_batches import PaddedBatch
    from poolbench.pooler.gradient_sums import GradientTee, norm_mask

    class Inner:
        def __call__(self, layer, hidden, extras) -> None:
            self.extras = dict(extras)

        def finish(self) -> None:
            pass

    rng = np.random.default_rng(3)
    rows, length, dim = 4, 9, 40
    mask = np.ones((rows, length), dtype=bool)
    mask[1, :3] = False  # left padding
    mask[2, 6:] = False  # right padding
    special = np.zeros_like(mask)
    special[0, 4] = True
    chunk = PaddedBatch(list(range(rows)), [f"p{r}" for r in range(rows)], ["x"] * rows,
                        rng.integers(0, 50, (rows, length)), mask, np.zeros((rows, length, 2), np.int32), special)
    hidden = torch.from_numpy(rng.standard_normal((rows, length, dim)).astype(np.float32) * 8).bfloat16()
    inner = Inner()
    tee = GradientTee(inner, chunk)
    tee(3, hidden, {"gradient_sum": torch.ones(rows, dim), "gradient_norm": torch.ones(rows, length)})
    tee.finish()
    assert set(inner.extras) == {"gradient_norm"}  # the sums are the tee's, the rest goes on
    expected = torch.where(torch.from_numpy(norm_mask(chunk)), torch.linalg.vector_norm(hidden.float(), dim=-1),
                           0.0).double().sum(dim=1)
    assert tee.layers == (3,) and tee.norm_sums is not None
    np.testing.assert_array_equal(tee.norm_sums[0], expected.numpy())
    np.testing.assert_array_equal(tee.norm_counts, norm_mask(chunk).sum(axis=1))
