"""S3_iti_probe: head selection sees only the training labels of each D1 fold, and the whole path runs
end to end (pool_concept_tables -> PooledTable + ITIHeadTable -> probe_pooled_table, in memory and through the
artifact store)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from negation_pairs import WORDS, passages
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.config import ProbingOptions
from poolbench.errors import StoreError
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.iti import ITIHeadView, head_table_key
from poolbench.pooler.parses import load_nlp
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import get_strategy, list_strategies
from poolbench.pooler.worker import ExtractorWorker
from poolbench.prober.auroc import ProbeError
from poolbench.prober.concept_probe import gather_layer_d1, probe_layer_task, probe_pooled_table
from poolbench.prober.d1 import cv_splits
from poolbench.prober.supervised import HeadSelectionCell, evaluate_d1_supervised, n_heads_kept
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore

N_TRAIN, N_TEST, N_FOLDS = 200, 80, 5


def labelled(n: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Matched pairs: rows 2i (pos) and 2i+1 (neg) share group offset+i."""
    y = np.tile([1, 0], n // 2)
    groups = np.repeat([f"g{offset + i}" for i in range(n // 2)], 2)
    return y, groups


def signal(y: np.ndarray, rows: np.ndarray, rng: np.random.Generator, dim: int) -> np.ndarray:
    """[n, dim] noise, with rows `rows` replaced by a strong copy of their label."""
    out = rng.normal(size=(len(y), dim))
    out[rows] = 4.0 * (2 * y[rows, None] - 1) + 0.1 * rng.normal(size=(len(rows), dim))
    return out


def test_heads_kept_are_a_fraction_of_the_model_heads() -> None:
    assert [n_heads_kept(h) for h in (1, 2, 4, 8, 32)] == [1, 1, 1, 2, 8]
    assert n_heads_kept(32, 0.5) == 16


def test_head_selection_never_sees_test_labels() -> None:
    """Head 0 predicts the *test* labels perfectly and nothing on train; head 1 predicts 30% of the train
    labels. Selection on the train split must keep head 1; selection that also looked at the test rows
    would keep head 0 and score test AUROC 1."""
    rng = np.random.default_rng(0)
    n_test = N_TRAIN
    y_tr, g_tr = labelled(N_TRAIN, 0)
    y_te, g_te = labelled(n_test, 10_000)
    y, groups = np.concatenate([y_tr, y_te]), np.concatenate([g_tr, g_te])
    train, test = np.arange(N_TRAIN), np.arange(N_TRAIN, N_TRAIN + n_test)
    some_train = rng.choice(train, size=int(0.3 * N_TRAIN), replace=False)
    features = np.stack([signal(y, test, rng, 2), signal(y, some_train, rng, 2),
                         rng.normal(size=(len(y), 2)), rng.normal(size=(len(y), 2))], axis=1)
    pooled = np.stack([signal(y, test, rng, 3), rng.normal(size=(len(y), 3)),
                       rng.normal(size=(len(y), 3)), rng.normal(size=(len(y), 3))])
    cell = HeadSelectionCell(pooled, features, y, groups, n_keep=1)
    result = evaluate_d1_supervised(cell, y, groups, train, test, n_folds=N_FOLDS, n_bootstrap=50)
    assert cell.chosen == [[1]] * (N_FOLDS + 1)
    assert result["logistic"].test_auroc < 0.75


def test_head_selection_inside_a_fold_never_sees_that_folds_validation_labels() -> None:
    """Head k predicts exactly the labels of D1 fold k's validation rows (noise elsewhere), in its features
    and its pooled vector. Fold k must never pick head k: on fold k's training rows head k is pure noise."""
    rng = np.random.default_rng(1)
    y, groups = labelled(N_TRAIN, 0)
    test = np.arange(N_TRAIN, N_TRAIN + N_TEST)
    y_te, g_te = labelled(N_TEST, 10_000)
    y_all, g_all = np.concatenate([y, y_te]), np.concatenate([groups, g_te])
    splits = cv_splits(y, groups, N_FOLDS, seed=0)
    features = np.stack([signal(y_all, val, rng, 2) for _, val in splits], axis=1)  # [N, 5 heads, 2]
    pooled = np.stack([signal(y_all, val, rng, 3) for _, val in splits])
    cell = HeadSelectionCell(pooled, features, y_all, g_all, n_keep=1)
    result = evaluate_d1_supervised(cell, y_all, g_all, np.arange(N_TRAIN), test, n_folds=N_FOLDS,
                                    n_bootstrap=50)
    for k, heads in enumerate(cell.chosen[:N_FOLDS]):
        assert heads != [k], f"fold {k} picked the head that encodes its own validation labels"
    assert result["logistic"].cv_auroc < 0.75  # a leak would give one fold AUROC 1


# ----------------------------------------------------------------------------- end to end on a tiny Llama

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32,
                                         vocab_size=len(tokenizer))).eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, model_id="tiny",
                       path=Path(tmp_path_factory.mktemp("m")), kind="causal", n_layers=2, hidden_size=16,
                       dtype=torch.float32, device=torch.device("cpu"), weights_hash="tiny",
                       decoder_layers=model.model.layers)


def test_s3_pools_a_head_table_and_the_prober_evaluates_one_cell(tiny) -> None:
    data = passages(12, "train") + passages(6, "test")
    out = pool_concept_tables(tiny, data, [0, 1], [get_strategy("A1"), get_strategy("S3_iti_probe")],
                              batch_size=8)
    table, heads = out.pooled, out.heads
    assert set(table.column("strategy").to_pylist()) == {"A1_mean", "S3_iti_probe"}  # real strategies only
    assert table.num_rows == 36 * 2 * 2
    assert table.schema.metadata[b"S3_iti_probe:heads"] == b"4"
    # One row per (passage, layer, head): the head's pooled vector at hidden width 16, its own output at head
    # width 16 / 4 heads = 4, no padding.
    assert heads.num_rows == 36 * 2 * 4
    assert heads.schema.field("pooled").type == pa.list_(pa.float32(), 16)
    assert heads.schema.field("output").type == pa.list_(pa.float32(), 4)
    assert heads.schema.metadata[b"S3_iti_probe:head_fraction"] == b"0.25"
    assert set(heads.column("head").to_pylist()) == {0, 1, 2, 3}
    # Each head's inflow weights sum to 1 and so does their mean: the all-heads row is the mean of the heads.
    main = PooledTableView(table).matrix(1, "S3_iti_probe")
    per_head, outputs = ITIHeadView(heads).cell(1, "S3_iti_probe", main.passage_ids)
    assert per_head.shape == (4, 36, 16) and outputs.shape == (36, 4, 4)
    np.testing.assert_allclose(per_head.mean(axis=0), main.X, atol=1e-5)
    records = probe_pooled_table(table, "negation", n_folds=3, n_bootstrap=20, heads=heads)
    cells = {(r.layer, r.strategy) for r in records}
    assert cells == {(layer, s) for layer in (0, 1) for s in ("A1_mean", "S3_iti_probe")}
    s3 = [r for r in records if r.strategy == "S3_iti_probe"]
    assert all(len(r.heads_selected) == 1 and r.fallback_count == 0 for r in s3)
    with pytest.raises(ProbeError, match="'S3_iti_probe' layer 0: supervised, but its ITIHeadTable was not given"):
        probe_pooled_table(table, "negation", n_folds=3, n_bootstrap=20)


def test_the_worker_stores_the_head_table_and_the_probe_task_reads_it(tiny_llama_dir, tmp_path) -> None:
    """Through the artifact store, D1 of S3 equals D1 in memory; a PooledTable whose head table is gone
    stops the probe task instead of probing S3 without its heads."""
    store_url = str(tmp_path / "store")
    worker = ExtractorWorker(str(tiny_llama_dir))
    data = passages(12, "train") + passages(6, "test")
    strategies = ["A1_mean", "S3_iti_probe"]
    worker.pool_concept("negation", data, [0, 1], strategies, store_url=store_url, key="pooled/k",
                        metadata={"concept": "negation"}, batch_size=8, max_length=64)
    store = LocalStore(tmp_path / "store")
    shards = [layer_shard_key("pooled/k", layer) for layer in (0, 1)]
    assert all(store.exists(head_table_key(shard)) for shard in shards)
    for layer in (0, 1):
        probe_layer_task(store_url, "pooled/k", "d1/k", "negation", layer,
            ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False))
    gather_layer_d1(store, "d1/k", [0, 1])
    stored = store.get_table("d1/k").to_pylist()
    out = pool_concept_tables(worker.loaded, data, [0, 1], [get_strategy(s) for s in strategies], batch_size=8,
                              max_length=64)
    in_memory = probe_pooled_table(out.pooled, "negation", n_folds=3, n_bootstrap=20, reliability=False,
                                   heads=out.heads)
    assert len(stored) == len(in_memory) == 2 * 2 * 2
    for got, want in zip(stored, in_memory, strict=True):
        assert (got["layer"], got["strategy"], got["probe"]) == (want.layer, want.strategy, want.probe)
        assert got["test_auroc"] == want.test_auroc and got["cv_auroc"] == want.cv_auroc
        assert got["heads_selected"] == want.heads_selected
    assert all(len(r["heads_selected"]) == 1 for r in stored if r["strategy"] == "S3_iti_probe")  # 2 heads: 1
    store.delete(head_table_key(shards[1]))
    with pytest.raises(StoreError):
        probe_layer_task(store_url, "pooled/k", "d1/k2", "negation", 1,
            ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False))


def test_every_strategy_through_pool_concept_reports_fallbacks_per_cell(tiny) -> None:
    """All card strategies and variants in one pool_concept call (spaCy parses, attention, gradients, train
    statistics); L3 falls back exactly on the passages where spaCy finds no entity, and D1 counts them."""
    data = passages(12, "train") + passages(6, "test")
    specs = list_strategies(include_reference=True)
    out = pool_concept_tables(tiny, data, [1], specs, batch_size=16)
    table = out.pooled
    view = PooledTableView(table)
    for spec in specs:
        cell = view.matrix(1, spec.id)
        assert np.isfinite(cell.X).all() and len(cell.y) == len(data)
    nlp = load_nlp()
    no_entity = {p.id: not nlp(p.text).ents for p in data}
    l3_cell = view.matrix(1, "L3_entity")
    assert l3_cell.fallback.tolist() == [no_entity[pid] for pid in l3_cell.passage_ids]
    assert sum(no_entity.values()) > len(data) // 2  # word salad: mostly no entity
    assert not view.matrix(1, "S2_gradient").fallback.any() and not view.matrix(1, "L6_sentence").fallback.any()
    records = probe_pooled_table(table, "negation", n_folds=3, n_bootstrap=10, heads=out.heads)
    l3 = [r for r in records if r.strategy == "L3_entity"]
    n_fallback = sum(no_entity.values())
    assert l3 and all(r.fallback_count == n_fallback and r.fallback_rate == n_fallback / len(data) for r in l3)
    sif, plain = view.matrix(1, "S2_sif_pc1"), view.matrix(1, "S2_sif")
    for split in ("train", "test"):  # each split's centred first component is gone from that split's vectors
        rows = plain.X[plain.split == split].astype(np.float64)
        u = np.linalg.svd(rows - rows.mean(axis=0), full_matrices=False)[2][0]
        np.testing.assert_allclose(sif.X[sif.split == split] @ u, 0, atol=1e-3)


@pytest.mark.parametrize(("heads", "shape"), [(1, (4, 3, 5)), (8, (32, 6, 64)), (13, (16, 2, 2)), (32, (32, 40, 9))])
def test_the_mean_of_the_chosen_heads_is_numpys_mean_of_their_copy_to_the_bit(heads, shape) -> None:
    """S3's design averages the chosen heads' pooled vectors one slice after another, without numpy's copy of
    them (524 MB a design at the driver's size); the very bits of pooled[heads].mean(axis=0), for one head, for
    make run's 8 of 32 and for shapes whose rows are short."""
    from poolbench.prober.supervised import mean_of_heads
    pooled = np.random.default_rng(heads).normal(size=shape) * 10.0 ** np.arange(-3, 3)[:, None, None][
        np.arange(shape[0]) % 6]
    chosen = sorted(np.random.default_rng(7).choice(shape[0], size=min(heads, shape[0]), replace=False).tolist())
    ours = mean_of_heads(pooled, chosen)
    assert ours.tobytes() == pooled[chosen].mean(axis=0).tobytes()
    assert not np.shares_memory(ours, pooled)
    stored = pooled.astype(np.float32)  # as the head table holds them: widened while added, no float64 copy kept
    assert mean_of_heads(stored, chosen).tobytes() == stored.astype(np.float64)[chosen].mean(axis=0).tobytes()


def test_a_design_holds_one_mean_not_a_copy_of_its_chosen_heads() -> None:
    """What design allocates on the host beside the cell: the mean (and the head ranking's small fits), never the
    chosen heads' [k, N, d] copy (restoring pooled[heads].mean(axis=0) fails the bound)."""
    import tracemalloc
    y, groups = labelled(200, 0)
    rng = np.random.default_rng(2)
    cell = HeadSelectionCell(pooled=rng.normal(size=(8, 200, 512)), features=rng.normal(size=(200, 8, 4)), y=y,
                             groups=groups, n_keep=4)
    copy_bytes = 4 * 200 * 512 * 8
    tracemalloc.start()
    try:
        X = cell.design(np.arange(160))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert X.shape == (200, 512) and peak < 0.5 * copy_bytes, (peak, copy_bytes)


def _ranked_heads(seed: int = 4, heads: int = 12, n: int = 120):
    """Features [n, heads, 6]: head h carries the label at strength 0.15·h, so the heads rank apart."""
    rng = np.random.default_rng(seed)
    y, groups = labelled(n, 0)
    features = rng.normal(size=(n, heads, 6))
    features[:, :, 0] += (2 * y[:, None] - 1) * 0.15 * np.arange(heads)
    return features, y, groups


def test_the_primal_batch_fits_each_head_and_fold_as_the_host_estimator_does() -> None:
    """Every (head, fold) fit of one primal solve scores held-out rows as NewtonLogisticProbe's fit on the same rows,
    within the bound two fits stopped at |gradient| < tol can differ by (test_batched_logistic's _bound)."""
    from test_batched_logistic import _bound

    from poolbench.prober.newton_logistic import NewtonLogisticProbe
    from poolbench.prober.primal_logistic import fit_primal
    features, y, _ = _ranked_heads()
    X = torch.as_tensor(np.ascontiguousarray(features.transpose(1, 0, 2)))
    folds = [np.arange(0, 80), np.arange(40, 120), np.r_[0:40, 80:120]]
    fits = fit_primal(X, folds, [y[f] for f in folds])
    scores = fits.scores(X).numpy()  # [heads, folds, rows]
    for h in (0, 5, 11):
        for k, rows in enumerate(folds):
            held = np.setdiff1d(np.arange(120), rows)
            host = NewtonLogisticProbe().fit(features[rows, h], y[rows])
            gap = np.abs(scores[h, k, held] - host.decision_function(features[held, h]))
            assert (gap <= _bound(host, features[held, h], y[held])).all(), (h, k)
    # a fit that stops at max_iter short of tol: the solve declines (None) and the caller takes the host estimator
    assert fit_primal(X, folds, [y[f] for f in folds], tol=1e-30, max_iter=3) is None


def _auroc_slack(features: np.ndarray, y: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Per head, how far two solvers' fold-mean AUROCs can lie apart when each fit stops within the stopping rule's
    bound of the optimum (test_batched_logistic's _bound on the scores): a (positive, negative) pair of a fold's
    validation rows can change order only where their scores lie within the sum of their bounds, each such pair one
    1/(n_pos·n_neg) of that fold's AUROC. 0 where no pair is that close."""
    from test_batched_logistic import _bound

    from poolbench.prober.newton_logistic import NewtonLogisticProbe
    slack = np.zeros(features.shape[1])
    for h in range(features.shape[1]):
        for fit, val in folds:
            model = NewtonLogisticProbe().fit(features[fit, h], y[fit])
            scores, bound = model.decision_function(features[val, h]), _bound(model, features[val, h], y[val])
            pos, neg = y[val] == 1, y[val] == 0
            close = np.abs(scores[pos][:, None] - scores[neg][None, :]) <= bound[pos][:, None] + bound[neg][None, :]
            slack[h] += close.sum() / (pos.sum() * neg.sum()) / len(folds)
    return slack


def test_s3_ranks_its_heads_in_one_primal_solve_on_the_probes_device(monkeypatch) -> None:
    """Where the probes have a GPU, S3's head ranking is one primal solve there (the CPU twin here, the same code on
    the CPU), not heads x folds host fits: the same heads kept, each AUROC within what the stopping rule lets two
    solvers' differ by (_auroc_slack), with and without grouped folds; restoring the host path leaves the solve
    uncalled."""
    from sklearn.model_selection import StratifiedGroupKFold

    from poolbench.prober import supervised
    features, y, groups = _ranked_heads()
    host = supervised.head_aurocs(features, y, groups, seed=3)
    calls = []
    real = supervised.fit_primal
    monkeypatch.setattr(supervised, "fit_primal", lambda *a, **k: calls.append(1) or real(*a, **k))
    cpu = torch.device("cpu")
    ranked = supervised.head_aurocs(features, y, groups, seed=3, device=cpu)
    assert calls == [1]
    folds = list(StratifiedGroupKFold(supervised.INNER_FOLDS, shuffle=True, random_state=3).split(
        np.zeros((y.size, 1)), y, groups))
    assert (np.abs(ranked - host) <= _auroc_slack(features, y, folds)).all()
    kept = lambda scores: sorted(range(scores.size), key=lambda h: (-scores[h], h))[:4]  # noqa: E731
    assert kept(ranked) == kept(host) and len(set(host.tolist())) > 6  # the heads rank apart: not a tie's order
    few = slice(0, 4)  # two pairs: fewer groups than folds, the training AUROC of an all-rows fit
    every = [(np.arange(4), np.arange(4))]
    gap = np.abs(supervised.head_aurocs(features[few], y[few], groups[few], device=cpu)
                 - supervised.head_aurocs(features[few], y[few], groups[few]))
    assert (gap <= _auroc_slack(features[few], y[few], every)).all()


def test_an_s3_cell_on_the_probes_device_keeps_the_host_cells_heads_and_records() -> None:
    """The whole cell with its fits on a device (the CPU twin): its head rankings in primal solves, its logistic
    probe's fold and test fits through batched_logistic, DiffMean on the host: the heads each fold keeps and every
    record field as the host estimators give them, the held-out scores within the stopping rule's bound."""
    from test_batched_logistic import _bound

    from poolbench.prober.newton_logistic import NewtonLogisticProbe
    from poolbench.prober.supervised import mean_of_heads
    features, y, groups = _ranked_heads(seed=5, n=160)
    pooled = (np.random.default_rng(1).normal(size=(12, 160, 5)) + (2 * y[None, :, None] - 1) * 0.1
              * np.arange(12)[:, None, None]).astype(np.float32)
    train, test = np.arange(120), np.arange(120, 160)
    cells = [HeadSelectionCell(pooled, features, y, groups, n_keep=3, device=device)
             for device in (None, torch.device("cpu"))]
    host, on_device = (evaluate_d1_supervised(c, y, groups, train, test, n_folds=N_FOLDS, n_bootstrap=50)
                       for c in cells)
    assert cells[0].chosen == cells[1].chosen and len(cells[0].chosen) == N_FOLDS + 1
    X = mean_of_heads(pooled, cells[0].chosen[-1])
    reference = NewtonLogisticProbe().fit(X[train], y[train])
    bound = _bound(reference, X[test], y[test])
    gap = np.abs(on_device["logistic"].test_scores - host["logistic"].test_scores)
    assert (gap <= bound).all() and not (gap == 0).all()  # within the stopping rule; two solvers, not one twice
    # so the 0/1 predictions agree where every score sits further from 0 than the bound, as here
    assert (np.abs(host["logistic"].test_scores) > bound).all()
    for name in host.probes:
        assert on_device[name].to_record() == host[name].to_record(), name
        np.testing.assert_array_equal(on_device[name].test_pred, host[name].test_pred)


def test_the_prober_hands_s3_its_gpu_and_keeps_the_host_path_on_a_cpu(tiny, monkeypatch) -> None:
    """probe_pooled_cells gives S3's cell the probes' device where it is a GPU (a stand-in here, the fits then run
    on the CPU twin) and none on a CPU; the records are the same either way."""
    from poolbench.prober import concept_probe, supervised
    data = passages(12, "train") + passages(6, "test")
    out = pool_concept_tables(tiny, data, [1], [get_strategy("A1"), get_strategy("S3_iti_probe")], batch_size=8)
    seen = []
    real = supervised.head_selection_cell

    def spy(*args, device=None, **kwargs):
        seen.append(device)
        return real(*args, device=None if device is None else torch.device("cpu"), **kwargs)

    monkeypatch.setattr(concept_probe, "head_selection_cell", spy)
    host = probe_pooled_table(out.pooled, "negation", n_folds=3, n_bootstrap=20, heads=out.heads)
    gpu = type("Gpu", (), {"type": "cuda"})()
    monkeypatch.setattr(concept_probe, "probe_device", lambda: gpu)
    ranked = probe_pooled_table(out.pooled, "negation", n_folds=3, n_bootstrap=20, heads=out.heads)
    assert seen == [None, None, gpu, gpu]  # each run's two cells (A1, S3): the device only where it is a GPU
    assert [r.model_dump() for r in ranked] == [r.model_dump() for r in host]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_s3_cell_on_cuda_keeps_the_host_cells_heads_and_records() -> None:
    features, y, groups = _ranked_heads(seed=5, n=160)
    pooled = np.random.default_rng(1).normal(size=(12, 160, 5)).astype(np.float32)
    train, test = np.arange(120), np.arange(120, 160)
    cells = [HeadSelectionCell(pooled, features, y, groups, n_keep=3, device=device)
             for device in (None, torch.device("cuda"))]
    host, on_gpu = (evaluate_d1_supervised(c, y, groups, train, test, n_folds=N_FOLDS, n_bootstrap=50) for c in cells)
    assert cells[0].chosen == cells[1].chosen
    for name in host.probes:
        assert on_gpu[name].to_record() == host[name].to_record(), name
