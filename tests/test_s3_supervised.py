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
