"""Pooling jobs fitted to the extractors' host memory before the first forward: cheapest cut first (groups into
single concepts, two jobs an extractor into one, a concept's layers into passes), a concept of which one layer does
not fit stops the run with one line, and a concept pooled in passes gets the records of one pooled whole."""

from __future__ import annotations

import pytest
from negation_pairs import passages

from poolbench.config import RunConfig
from poolbench.driver import concept_pass
from poolbench.driver.host_room import HOST_SHARE, JOB_FIXED, VectorBytes, extractor_budget, fit_host_room
from poolbench.driver.pipeline import run_benchmark
from poolbench.driver.run_plan import ConceptPlan
from poolbench.errors import PoolBenchError
from poolbench.pooler.pooled_table import pooled_layers
from poolbench.pooler.registry import resolve_strategies
from poolbench.pooler.stored_size import vector_bytes_per_passage_layer, write_copy_bytes_per_passage_layer
from poolbench.pooler.worker import ExtractorWorker
from poolbench.records.events import ConceptPooled, PoolingFitted, RunEvent
from poolbench.store.local import LocalStore
from poolbench.store.s3 import S3Store


def concept(name: str, n_passages: int, layers: list[int]) -> tuple[ConceptPlan, list[int]]:
    return ConceptPlan(name, passages(n_passages // 2, "train"), f"h-{name}"), layers


def test_a_plan_that_fits_is_left_as_it_is_and_a_job_is_its_vectors_times_the_write_peak() -> None:
    per = VectorBytes(held=100, copied=200, fixed=0)
    groups = [[concept("a", 10, [0, 1]), concept("b", 10, [0, 1])]]
    assert per.job(groups[0]) == 3 * 100 * 10 * 2 * 2 == 12_000
    assert VectorBytes(100, 50, 7).job(groups[0]) == 150 * 40 + 7 == 6_007
    plan = fit_host_room(groups, per, budget=2 * 12_000, slots=2)
    assert (plan.groups, plan.slots, plan.passes, plan.steps) == (groups, 2, {}, ())


def test_each_cut_is_taken_only_when_the_one_before_does_not_fit() -> None:
    per = VectorBytes(held=2, copied=4, fixed=0)  # 6 bytes a passage and layer at the write peak
    a, b = concept("a", 10, [0, 1, 2, 3]), concept("b", 10, [0, 1, 2, 3])  # 240 bytes a concept, 480 the pair
    # two slots of single concepts fit 480
    split = fit_host_room([[a, b]], per, budget=480, slots=2)
    assert split.groups == [[a], [b]] and split.slots == 2 and split.passes == {}
    assert split.steps == ("concepts sharing forwards pooled one a job",)
    # one job an extractor: 240 fits 240
    one = fit_host_room([[a, b]], per, budget=240, slots=2)
    assert one.groups == [[a], [b]] and one.slots == 1 and one.passes == {}
    # passes: 3 layers' 180 bytes fit 239, the 4th is a pass of its own
    passes = fit_host_room([[a], [b]], per, budget=239, slots=2)
    assert passes.slots == 1 and passes.passes == {"a": 2, "b": 2}
    assert [[(plan.concept, layers) for plan, layers in group] for group in passes.groups] == [
        [("a", [0, 1, 2])], [("a", [3])], [("b", [0, 1, 2])], [("b", [3])]]
    assert passes.steps[-1].startswith("2 concept(s) pooled in passes over their layers")
    # a concept that fits is not cut although another one is
    small = concept("s", 2, [0, 1, 2, 3])
    mixed = fit_host_room([[a], [small]], per, budget=120, slots=1)
    assert [[(p.concept, layers) for p, layers in g] for g in mixed.groups] == [
        [("a", [0, 1])], [("a", [2, 3])], [("s", [0, 1, 2, 3])]]


def test_a_concept_of_which_one_layer_does_not_fit_stops_the_run_with_one_line() -> None:
    with pytest.raises(PoolBenchError) as err:
        fit_host_room([[concept("toxicity", 2000, [0, 5])]], VectorBytes(868_352, 2 * 868_352, 0), budget=5_000_000_000,
                      slots=2)
    message = str(err.value)
    assert "\n" not in message and message.startswith("concept toxicity: one layer's pooled vectors (2000 passages)")
    assert "need at least 5.2 GB of host memory while written, and an extractor has 5.0 GB" in message
    assert "fewer strategies" in message


def test_extractors_on_one_host_share_its_memory_and_the_smallest_share_is_the_budget() -> None:
    rooms = [{"host": "h1", "available": 100_000}, {"host": "h1", "available": 100_000},
             {"host": "h2", "available": 120_000}]
    assert extractor_budget(rooms) == int(HOST_SHARE * 100_000 / 2)
    assert extractor_budget([{"host": "h2", "available": 120_000}]) == int(HOST_SHARE * 120_000)


def test_the_8b_full_benchmark_at_every_layer_fits_a_128_gb_host_one_job_at_a_time() -> None:
    """The 19 card strategies on an 8B shape at the full corpus (2,000 passages a concept): 868,352 float32 bytes a
    passage and layer, 311,296 of them PooledTable rows. Into a folder store at float32 a job peaks at its vectors
    plus its rows' single-chunk copy: two jobs of 14.3 GB at 6 layers fit HOST_SHARE of 128 GB as planned, and at
    all 32 one job (75.6 GB) at a time, no passes; an S3 store likewise (it spools each table to a file and uploads
    that). A store that serialises tables in memory adds the vectors again: 111.3 GB at 32 layers, two passes a
    concept (28 layers, then 4); a 16-bit store half of them: 83.5 GB."""
    specs = resolve_strategies(None)
    shape = (specs, 4096, 32, 128)
    f32 = vector_bytes_per_passage_layer(*shape, "float32")
    assert (f32, len(specs) * 4096 * 4) == (868_352, 311_296)
    folder = VectorBytes(f32, write_copy_bytes_per_passage_layer(*shape, "float32", False))
    buffered = VectorBytes(f32, write_copy_bytes_per_passage_layer(*shape, "float32", True))
    half = VectorBytes(f32, write_copy_bytes_per_passage_layer(*shape, "bfloat16", True))
    assert (folder.copied, buffered.copied, half.copied) == (311_296, 868_352, 434_176)
    budget = extractor_budget([{"host": "gpu-box", "available": 128_000_000_000}])
    six = fit_host_room([[concept(c, 2000, [0, 6, 12, 19, 25, 31])] for c in ("a", "b")], folder, budget, slots=2)
    assert six.steps == () and six.slots == 2 and round(folder.job(six.groups[0]) / 1e9, 1) == 14.3
    every = [[concept(c, 2000, list(range(32)))] for c in ("a", "b")]
    one = fit_host_room(every, folder, budget, slots=2)
    assert one.slots == 1 and one.passes == {} and round(folder.job(every[0]) / 1e9, 1) == 75.6
    assert round(half.job(every[0]) / 1e9, 1) == 83.5 and fit_host_room(every, half, budget, slots=2).passes == {}
    assert S3Store.buffers_tables is False and LocalStore.buffers_tables is False
    in_memory = fit_host_room(every, buffered, budget, slots=2)
    assert in_memory.slots == 1 and in_memory.passes == {"a": 2, "b": 2}
    assert round(buffered.job(every[0]) / 1e9, 1) == 111.3
    assert [len(layers) for group in in_memory.groups for _, layers in group] == [28, 4, 28, 4]


STRATEGIES = ("A1_mean", "P1_last", "S3_iti_probe")


def run(model, store, events: list[RunEvent] | None = None):
    cfg = RunConfig(model=str(model), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging", "toxicity"),
                    strategies=STRATEGIES, store=str(store), n_bootstrap=50, torch_threads=1, steering=False,
                    device="cpu")
    return run_benchmark(cfg, events.append if events is not None else None)


def test_concepts_pooled_in_layer_passes_get_the_records_of_concepts_pooled_whole(tiny_llama_dir, cache, tmp_path,
                                                                                   monkeypatch):
    whole = run(tiny_llama_dir, tmp_path / "whole")
    assert len(whole.layers) >= 2 and "pooled_in_passes" not in whole.computed
    held, copied = ExtractorWorker(str(tiny_llama_dir)).host_bytes_per_passage_layer(list(STRATEGIES), "float32",
                                                                                      False)
    one_layer = (held + copied) * max(whole.corpus["passages"].values()) + JOB_FIXED  # one layer of the larger
    monkeypatch.setattr(concept_pass, "extractor_budget", lambda rooms: one_layer)
    events: list[RunEvent] = []
    split = run(tiny_llama_dir, tmp_path / "split", events)
    assert split.computed["pooled_in_passes"] >= 1 and split.computed["pooled"] == 2
    [fitted] = [e for e in events if isinstance(e, PoolingFitted)]
    assert fitted.budget == one_layer and "pooled in passes over their layers" in fitted.line
    assert sorted(e.concept for e in events if isinstance(e, ConceptPooled)) == ["hedging", "toxicity"]
    assert [r.to_dict() for r in split.records] == [r.to_dict() for r in whole.records]
    store = LocalStore(tmp_path / "split")
    for artifacts in split.artifacts.values():  # the driver's manifest names every layer
        assert pooled_layers(store, artifacts["pooled"]) == list(split.layers)


@pytest.mark.parametrize(("dtype", "buffered"), [("bfloat16", False), ("float32", False), ("float32", True)])
def test_a_job_written_to_the_store_stays_within_the_write_peak_the_plan_counts(tmp_path, dtype, buffered) -> None:
    """The plan counts a job at its float32 vectors and what its writers add (a 16-bit store: half the vectors; a
    float32 folder store: the PooledTable rows' single-chunk copy, 19 x d x 4 bytes a passage and layer here; a
    store that serialises tables in memory, S3's way: the vectors again); the process that writes one (the
    pooling's own builders, then ExtractorWorker._store on one writer a layer, the most it holds) must stay under
    it. An extra copy of the vectors in the write path fails here, and so does a layer's float32 table held after
    it is encoded or a table serialised in memory by a folder store (checked by mutation: bench/README.md)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).parents[1] / "bench" / "shard_writes.py"
    out = tmp_path / "memory.json"
    subprocess.run([sys.executable, str(bench), "--memory", "--passages", "100", "--d", "4096", "--layers", "6",
                    "--memory-writers", "6", "--store-dtype", dtype, "--store", str(tmp_path), "--out", str(out),
                    *(["--buffered"] if buffered else [])], check=True, capture_output=True, cwd=bench.parent)
    memory = json.loads(out.read_text())["memory"]
    assert memory["writers"] == 6
    assert abs(memory["held_bytes"] - memory["planned_held_bytes"]) < 0.1 * memory["planned_held_bytes"]
    assert 0.95 * memory["held_bytes"] < memory["write_peak_bytes"] <= memory["planned_peak_bytes"]
    held, rows = memory["planned_held_bytes"], 100 * 6
    copied = held // 2 if dtype == "bfloat16" else held if buffered else 19 * 4096 * 4 * rows
    assert memory["planned_peak_bytes"] == held + copied + JOB_FIXED
