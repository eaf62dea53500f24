"""Learned aggregators through the real path on the tiny Llama: an ExtractorWorker pools a concept with LA3 (its
token states kept for the concept's forwards, the fits made in the worker), stores the LearnedFoldTable beside each
PooledTable shard, and the D1 task probes the learned cell fold by fold. The PooledTable's LA3 row is the
whole-train fit's vectors (what D2's DiffMean direction is taken from); S3 still pools its heads beside it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from device_reads import DeviceReads
from negation_pairs import passages

from poolbench.config import ProbingOptions
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.learned import LearnedFoldView, TokenKeeper, learned_table_key
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.worker import ExtractorWorker, PoolTask
from poolbench.prober.concept_probe import probe_layer_task
from poolbench.records.d1 import d1_records_from_table
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore


def test_a_worker_pools_fits_and_stores_a_learned_strategy_and_d1_probes_it_per_fold(tiny_llama_dir,
                                                                                      tmp_path) -> None:
    store_url = str(tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    corpus = passages(15, "train") + passages(8, "test")
    task = PoolTask("negation", corpus, "pooled/negation", {"corpus": "negation"}, (1,))
    worker = ExtractorWorker(str(tiny_llama_dir))
    [summary] = worker.pool_concepts([task], ["A1_mean", "S3_iti_probe", "LA3_multimax"], store_url=store_url,
                                     batch_size=8, max_length=64)
    assert summary["layers"] == [1]
    shard = layer_shard_key(task.key, 1)
    pooled = store.get_table(shard)
    learned = LearnedFoldView(store.get_table(learned_table_key(shard)))
    assert store.exists(head_table_key(shard))  # S3 beside it still has its heads
    view = PooledTableView(pooled)
    cell = view.matrix(1, "LA3_multimax")
    fits = learned.cell(1, "LA3_multimax", cell.passage_ids)
    assert fits.shape == (6, len(corpus), 32)
    assert np.array_equal(cell.X, fits[5])  # the PooledTable row is the whole-train fit
    described = learned.fits("LA3_multimax")
    train_ids = {p.id for p in corpus if p.split == "train"}
    assert set(described[5]["train"]) == train_ids
    assert all(set(fit["train"]) < train_ids and len(fit["train"]) == 24 for fit in described[:5])
    test_ids = {p.id for p in corpus if p.split == "test"}
    assert not any(set(fit["train"]) & test_ids for fit in described)
    # each test passage is pooled by every fit as a weighted mean of its own token states: the fits differ
    assert not np.array_equal(fits[0], fits[5])

    probe_layer_task(store_url, task.key, "d1/negation", "negation", 1,
        ProbingOptions(n_folds=5, seed=0, n_bootstrap=200, reliability=False))
    records = {(r.strategy, r.probe): r for r in d1_records_from_table(store.get_table(
        layer_shard_key("d1/negation", 1)))}
    la3 = records[("LA3_multimax", "logistic")]
    assert la3.n_train == 30 and la3.n_test == 16 and len(la3.cv_fold_aurocs) == 5
    assert la3.test_auroc > 0.75  # "if ... not" against "... sun": a max over tokens finds the cue
    assert la3.heads_selected is None and la3.mdl_online_bits is None


def test_a_run_with_a_learned_strategy_gives_ordinary_d1_cells_and_leaderboard_rows(tiny_llama_dir, local_ray,
                                                                                     cache, tmp_path) -> None:
    import json

    from poolbench.config import RunConfig
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.results.documents.document import write_run_outputs

    cfg = RunConfig(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging",),
                    strategies=("A1_mean", "LA3_multimax"), store=str(tmp_path / "store"), n_bootstrap=200,
                    torch_threads=1, steering=False)
    outcome = run_benchmark(cfg, lambda event: None)
    la3 = [r for r in outcome.records if r.strategy == "LA3_multimax"]
    assert len(la3) == 2 * len(outcome.layers)  # two probes per layer, like every strategy
    assert all(len(r.cv_fold_aurocs) == 5 and 0.0 <= r.ci_low <= r.test_auroc <= r.ci_high <= 1.0 for r in la3)
    paths = write_run_outputs(outcome, tmp_path / "out")
    rows = {row["strategy"]: row for row in json.loads(paths["leaderboard"].read_text())["strategies"]}
    assert rows["LA3_multimax"]["supervision"] == "labels" and "hedging" in rows["LA3_multimax"]["per_concept"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_token_keeper_keeps_each_rows_tokens_without_reading_the_device(dtype) -> None:
    """Each row's kept tokens (real and not special; a row of special tokens only keeps them all; a padding row
    none), as float32 and in order, the very values a boolean index a row gives; found on the host, so no layer's
    call reads the device (a boolean index is a nonzero inside: rows x layers reads a chunk, restored it fails)."""
    real = np.array([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    special = np.array([[1, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
    chunk = SimpleNamespace(attention_mask=real.astype(np.int64), special_mask=special)
    passed: list[int] = []
    keeper = TokenKeeper(lambda layer, hidden, extras: passed.append(layer), chunk, [0, 3])
    states = {layer: torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(layer)).to(dtype)
              for layer in (0, 3)}
    with DeviceReads() as reads:
        for layer, hidden in states.items():
            keeper(layer, hidden, {})
    assert passed == [0, 3] and reads.reads == []
    keep = torch.from_numpy(np.array([[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0], [0] * 6], bool))
    for layer, hidden in states.items():
        assert [len(row) for row in keeper.states[layer]] == [3, 2, 2, 0]
        for b, row in enumerate(keeper.states[layer]):
            assert row.dtype == torch.float32
            assert torch.equal(row, hidden[b][keep[b]].float())
