"""Several concepts sharing forwards (pool_concept_group): each concept's tables equal the concept pooled alone,
for every registered strategy, with each row weighted by its own concept's parses and train-split statistics.

Tolerance: a passage's forward in a group may pad it to another length, next to other rows, so its token states
may differ from its forward alone by float32 rounding (reductions over more masked keys): not bit for bit. The
tables are compared as tests/pooled_bounds.py says (every column but the vectors exactly, each vector within the
forward's round-off)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
from negation_pairs import passages
from pooled_bounds import TINY_LLAMA_TERMS, assert_same_tables
from tolerances import assert_float32_close

from poolbench.corpus.passage import Passage
from poolbench.driver.pool_groups import estimated_tokens, group_token_target, plan_groups
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.concept_pooling import ConceptPassages, pool_concept_group, pool_concept_tables
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.pooled_table import decode_vectors, pooled_layers
from poolbench.pooler.registry import list_strategies
from poolbench.pooler.worker import ExtractorWorker, PoolTask
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore

HEDGES = ["might", "perhaps", "could", "possibly", "seems", "the", "river", "report", "suggests", "rain"]


def hedging_passages(n_pairs: int, split: str, *, ids_from: str = "") -> list[Passage]:
    """A second concept whose passage ids are the negation corpus's own (ids are unique within a concept only):
    routing must go by row, never by id."""
    rng = np.random.default_rng(7 + len(split))
    out = []
    for i in range(n_pairs):
        words = " ".join(rng.choice(HEDGES, size=int(rng.integers(3, 14))))
        for label, text in ((1, f"It {words} maybe."), (0, f"It {words} surely. Yes.")):
            out.append(Passage(f"{ids_from}{split}{i}-{label}", text, label, "d", 8, f"{split}{i}", split,
                               "hedging"))
    return out


def members() -> list[ConceptPassages]:
    """Three concepts of different sizes (the smallest fills part of a batch only), duplicate ids across two."""
    negation = passages(12, "train") + passages(6, "test")
    hedging = hedging_passages(9, "train") + hedging_passages(4, "test")
    tiny = [replace(p, concept="contrast") for p in hedging_passages(2, "train", ids_from="c")
            + hedging_passages(1, "test", ids_from="c")]
    return [ConceptPassages(c[0].concept, c, {"concept": c[0].concept, "corpus": f"hash-{c[0].concept}"})
            for c in (negation, hedging, tiny)]


@pytest.mark.numerics  # a group's forwards pad and batch rows otherwise: bounded, and run on each kernel set
@pytest.mark.parametrize("overlap", [False, True])
def test_a_concept_pooled_in_a_group_equals_it_pooled_alone_for_every_strategy(tiny_llama_dir, overlap) -> None:
    loaded = load_model(str(tiny_llama_dir))
    specs = list_strategies(include_reference=True)
    assert {s.code for s in specs} >= {"P1", "A1", "A2", "W4", "S1", "S2", "S3", "L1", "L2", "L3", "L4", "L5", "L6"}
    assert any(dict(s.params).get("remove_first_pc") for s in specs)  # S2_sif_pc1, fitted per concept
    group = members()
    chunks: list[PaddedBatch] = []
    budget = 8 * 64  # whole batches of 8, whatever the default budget, so forwards can hold several concepts
    grouped = pool_concept_group(loaded, group, [0, 1], specs, batch_size=8, max_length=64,
                                 on_batch=lambda chunk, _: chunks.append(chunk), overlap=overlap,
                                 max_batch_tokens=budget)
    starts = np.cumsum([0] + [len(m.passages) for m in group])
    owners = [set(np.searchsorted(starts, chunk.indices, side="right") - 1) for chunk in chunks]
    assert sum(len(o) > 1 for o in owners) >= 2  # forwards really were shared between concepts
    assert len(chunks) < sum(-(-len(m.passages) // 8) for m in group)  # and fewer than one concept at a time
    for member, pooled in zip(group, grouped, strict=True):
        alone = pool_concept_tables(loaded, list(member.passages), [0, 1], specs, batch_size=8, max_length=64,
                                    metadata=dict(member.metadata), max_batch_tokens=budget)
        assert list(pooled.layers) == [0, 1] and pooled.skipped == alone.skipped == ()
        assert pooled.layer_heads is not None and alone.layer_heads is not None
        for layer in (0, 1):
            assert_same_tables(pooled.layers[layer], alone.layers[layer], f"{member.concept} layer {layer}")
            assert_same_tables(pooled.layer_heads[layer], alone.layer_heads[layer],
                               f"{member.concept} heads layer {layer}")
        assert pooled.layers[0].num_rows == len(specs) * len(member.passages)


def test_concept_statistics_reach_their_own_rows(tiny_llama_dir) -> None:
    """The same text pooled as a negation passage and as a hedging passage in one forward: rows whose weights
    read no concept statistics agree, L2 (its concept's triggers), L5 (its TF-IDF) and S2_sif (its unigram
    counts) do not, and each equals its concept's row pooled alone."""
    loaded = load_model(str(tiny_llama_dir))
    specs = [s for s in list_strategies(include_reference=True)
             if s.id in ("A1_mean", "L1_pos_filtered", "L2_dependency_rel", "L5_keyword", "S2_sif")]
    shared = "The report suggests it might rain; the cat sat home, the river sun surely not."
    negation = [*passages(4, "train"), Passage("x", shared, 1, "d", 8, "x", "test", "negation")]
    hedging = [*hedging_passages(4, "train"), Passage("x", shared, 1, "d", 8, "x", "test", "hedging")]
    group = [ConceptPassages("negation", negation), ConceptPassages("hedging", hedging)]
    tables = [p.layers[1] for p in pool_concept_group(loaded, group, [1], specs, batch_size=16, max_length=64)]

    def row(table: pa.Table, strategy: str) -> np.ndarray:
        keep = [i for i, (pid, s) in enumerate(zip(table.column("passage_id").to_pylist(),
                                                   table.column("strategy").to_pylist(), strict=True))
                if pid == "x" and s == strategy]
        return decode_vectors(table.take(keep))[0]

    for strategy in ("A1_mean", "L1_pos_filtered"):
        assert_float32_close(row(tables[0], strategy), row(tables[1], strategy), terms=TINY_LLAMA_TERMS,
                             err_msg=strategy)  # one text in two rows of one forward: equal up to round-off
    for strategy in ("L2_dependency_rel", "L5_keyword", "S2_sif"):
        assert not np.allclose(row(tables[0], strategy), row(tables[1], strategy), atol=1e-4), strategy
    for member, table in zip(group, tables, strict=True):
        alone = pool_concept_tables(loaded, list(member.passages), [1], specs, batch_size=16, max_length=64)
        assert_same_tables(table, alone.layers[1], member.concept)


def test_plan_groups_packs_consecutive_concepts_up_to_the_target_and_an_even_share() -> None:
    assert plan_groups([5, 5, 5], 0) == [[0], [1], [2]]
    assert plan_groups([40, 30, 50, 10, 10, 90], 100) == [[0, 1], [2, 3, 4], [5]]
    assert plan_groups([250, 10, 10], 100) == [[0], [1, 2]]  # a concept above the target pools alone
    # two workers: no group above half of all 180 tokens, so both get work
    assert plan_groups([40, 30, 50, 10, 10, 40], 1000, n_workers=2) == [[0, 1], [2, 3, 4], [5]]
    assert group_token_target(None, on_gpu=False, max_batch_tokens=None) == 0
    assert group_token_target(None, on_gpu=True, max_batch_tokens=None) == 16 * 8192
    assert group_token_target(None, on_gpu=True, max_batch_tokens=1000) == 16_000
    assert group_token_target(5000, on_gpu=False, max_batch_tokens=None) == 5000
    assert group_token_target(0, on_gpu=True, max_batch_tokens=None) == 0
    data = [Passage("a", "x" * 40, 1, "d", 0, None, "train", "c"), Passage("b", "y", 0, "d", 300, None, "train", "c")]
    assert estimated_tokens(data, max_length=256) == 11 + 256  # 40 characters / 4 + 1; 300 cut at max_length


def test_a_group_job_writes_each_concept_as_alone_and_a_retry_rewrites_only_what_is_missing(
        tiny_llama_dir, tmp_path) -> None:
    """Two concepts in one ExtractorWorker job: each one's shards, head shards and manifest under its own key hold
    what the concept pooled alone holds. Then the job 'dies' while writing the second concept (its layer-1 shard
    and manifest are gone) and is retried as Ray would, with the same arguments: only that shard is written."""
    store_url = str(tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    worker = ExtractorWorker(str(tiny_llama_dir))
    strategies = ["A1_mean", "L5_keyword", "S2_sif_pc1", "S3_iti_probe"]
    group = members()[:2]
    tasks = [PoolTask(m.concept, list(m.passages), f"pooled/{m.concept}", dict(m.metadata), (0, 1)) for m in group]
    kwargs = {"store_url": store_url, "batch_size": 8, "max_length": 64}
    summaries = worker.pool_concepts(tasks, strategies, **kwargs)
    assert [s["concept"] for s in summaries] == ["negation", "hedging"]
    assert all(s["layers"] == [0, 1] and s["group"] == ["negation", "hedging"] for s in summaries)
    for task, summary in zip(tasks, summaries, strict=True):
        alone = f"pooled/alone-{task.concept}"
        single = worker.pool_concept(task.concept, task.passages, [0, 1], strategies, key=alone,
                                     metadata=task.metadata, **kwargs)
        assert (summary["tokens"], summary["rows"]) == (single["tokens"], single["rows"])
        assert pooled_layers(store, task.key) == [0, 1] == pooled_layers(store, alone)
        for layer in (0, 1):
            shard, single = layer_shard_key(task.key, layer), layer_shard_key(alone, layer)
            assert_same_tables(store.get_table(shard), store.get_table(single), f"{task.concept} {layer}")
            assert_same_tables(store.get_table(head_table_key(shard)), store.get_table(head_table_key(single)),
                               f"{task.concept} heads {layer}")

    files = {key: (tmp_path / "store" / f"{key}.arrow") for task in tasks for key in
             (layer_shard_key(task.key, 0), layer_shard_key(task.key, 1))}
    stamps = {key: path.stat().st_mtime_ns for key, path in files.items()}
    lost = layer_shard_key("pooled/hedging", 1)
    before = store.get_table(lost)
    store.delete(lost)
    store.delete("pooled/hedging")
    again = worker.pool_concepts(tasks, strategies, **kwargs)
    assert [s["layers"] for s in again] == [[], [1]] and again[1]["group"] == ["hedging"]
    assert {key for key, path in files.items() if path.stat().st_mtime_ns != stamps[key]} == {lost}
    # pooled alone this time (the other concept is whole), so equal up to the rounding a shared forward makes
    assert_same_tables(store.get_table(lost), before, "rewritten")
    assert pooled_layers(store, "pooled/hedging") == [0, 1]
    assert [s["layers"] for s in worker.pool_concepts(tasks, strategies, **kwargs)] == [[], []]
