"""Per-passage scores are an artifact: every D1 cell stores the held-out and out-of-fold scores of the fit it
reported, in either store backend, and they reproduce the cell's AUROCs exactly (S3_iti_probe's fold-chosen heads
included); `--log-samples` reads them instead of refitting."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from negation_pairs import passages
from test_records import pooled_table
from test_s3_supervised import tiny  # noqa: F401  (the module fixture: a 2-layer Llama, 4 heads)

from poolbench.config import ProbingOptions
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.registry import get_strategy
from poolbench.prober.auroc import ProbeError, auroc
from poolbench.prober.concept_probe import gather_layer_d1, probe_layer, probe_pooled_cells
from poolbench.prober.passage_scores import (
    HELDOUT,
    NO_FOLD,
    OUT_OF_FOLD,
    PASSAGE_SCORES_SCHEMA,
    held_out_cells,
    passage_scores_key,
    passage_scores_of,
)
from poolbench.records.d1 import D1CellRecord, d1_records_from_table
from poolbench.results.exports.samples import sample_rows
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key


def check_reproduces(records: list[D1CellRecord], table: pa.Table) -> None:
    """Each record's test AUROC is the AUROC of its stored held-out scores, and each CV fold's AUROC that of
    the out-of-fold scores that fold scored: to the last bit (the same function on the same numbers)."""
    rows = passage_scores_of(table)
    for r in records:
        cell = [s for s in rows if (s.layer, s.strategy, s.probe) == (r.layer, r.strategy, r.probe)]
        held = [s for s in cell if s.kind == HELDOUT]
        oof = [s for s in cell if s.kind == OUT_OF_FOLD]
        assert len(held) == r.n_test and len(oof) == r.n_train
        assert {s.fold for s in held} == {NO_FOLD} and {s.fold for s in oof} == set(range(r.n_folds or 0))
        assert auroc(np.array([s.score for s in held]), np.array([s.label for s in held])) == r.test_auroc
        folds = [auroc(np.array([s.score for s in oof if s.fold == k]), np.array([s.label for s in oof if s.fold == k]))
                 for k in range(r.n_folds or 0)]
        assert folds == pytest.approx(r.cv_fold_aurocs, abs=1e-15) and np.mean(folds) == pytest.approx(r.cv_auroc)


def test_the_stored_scores_reproduce_every_cell_in_either_store(artifact_store: ArtifactStore) -> None:
    table = pooled_table()  # A1_mean and P1_last at layer 3: 12 train and 6 test pairs
    ids = table.column("passage_id").to_pylist()
    tiers = {pid: ("hard" if pid.startswith("test-0") else "standard") for pid in ids}
    artifact_store.put_table(layer_shard_key("pooled/k", 3), table)
    probe_layer(artifact_store, "pooled/k", "d1/k", "c", 3,
        ProbingOptions(n_folds=3, seed=0, n_bootstrap=50, reliability=False), tiers=tiers)
    gather_layer_d1(artifact_store, "d1/k", [3])
    stored = artifact_store.get_table(passage_scores_key("d1/k"))
    assert stored.schema == PASSAGE_SCORES_SCHEMA
    assert stored.num_rows == 2 * 2 * (24 + 12)  # strategies x probes x (train out-of-fold + test held-out)
    assert stored.equals(artifact_store.get_table(passage_scores_key(layer_shard_key("d1/k", 3))))
    assert {column.num_chunks for column in stored.columns} == {1}  # one record batch, not one per cell
    records = d1_records_from_table(artifact_store.get_table("d1/k"))
    check_reproduces(records, stored)
    rows = passage_scores_of(stored)
    assert {(s.passage_id, s.tier) for s in rows if s.passage_id.startswith("test-0")} == {
        ("test-0-1", "hard"), ("test-0-0", "hard")}
    assert all(s.pair_id == s.passage_id.rsplit("-", 1)[0] for s in rows)  # the matched pair is the group


def test_s3_stores_the_scores_of_its_fold_chosen_heads(tiny) -> None:  # noqa: F811
    data = passages(12, "train") + passages(6, "test")
    out = pool_concept_tables(tiny, data, [1], [get_strategy("A1"), get_strategy("S3_iti_probe")], batch_size=8)
    records, table = probe_pooled_cells(out.pooled, "negation", n_folds=3, n_bootstrap=20, reliability=False,
                                        heads=out.heads)
    assert {r.strategy for r in records} == {"A1_mean", "S3_iti_probe"}
    check_reproduces(records, table)


def test_samples_are_read_from_the_table_and_a_broken_table_is_named() -> None:
    records, table = probe_pooled_cells(pooled_table(), "c", n_folds=3, n_bootstrap=20, reliability=False)
    board = {"probe": "logistic", "strategies": [
        {"strategy": s, "best_layer": 3, "per_concept": {"c": {}}} for s in ("A1_mean", "P1_last")]}
    rows = list(sample_rows(board, table))
    assert len(rows) == 2 * 12
    for strategy in ("A1_mean", "P1_last"):
        mine = [r for r in rows if r["strategy"] == strategy]
        record = next(r for r in records if (r.strategy, r.probe) == (strategy, "logistic"))
        assert auroc(np.array([r["score"] for r in mine]), np.array([r["label"] for r in mine])) == record.test_auroc
        assert all(r["prediction"] == int(r["score"] > 0) for r in mine)
    cells = held_out_cells(table, {"A1_mean": 3, "P1_last": 3}, "logistic")
    a, p = cells[("c", "A1_mean")], cells[("c", "P1_last")]
    assert list(a.passage_ids) == sorted(a.passage_ids) and np.array_equal(a.passage_ids, p.passage_ids)
    with pytest.raises(ProbeError, match="lacks column"):
        passage_scores_of(table.drop_columns(["tier"]))
