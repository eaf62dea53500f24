"""`run --drop-pooled` end to end on a real local Ray: each concept's vectors (shards, S3's head tables, S2's gradient
sums) leave the store once its D1 is stored, with the records of a run that keeps them; the pooling runs only as far
ahead as the store's room allows (on a CPU, where the probes otherwise wait for all pooling, and beside it); a rerun
pools nothing; a resumed run pools only the layers whose D1 is missing; steering is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from poolbench.config import RunConfig
from poolbench.driver import concept_pass
from poolbench.driver.host_room import JOB_FIXED
from poolbench.driver.pipeline import run_benchmark
from poolbench.driver.room_gate import RoomGate
from poolbench.driver.store_room import ROOM_SHARE
from poolbench.errors import PoolBenchError
from poolbench.pooler.pooled_drop import pooled_keys
from poolbench.pooler.worker import ExtractorWorker
from poolbench.prober.passage_scores import passage_scores_key
from poolbench.records.events import ConceptPooled, ConceptProbed, ConceptProgress, PoolingRoom, RunEvent
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore

STRATEGIES = ("A1_mean", "S2_gradient", "S3_iti_probe")  # shards, gradient sums and S3's head tables


def config(model: Path, store: str, **overrides) -> RunConfig:
    """test_pipeline's run: corpus v1's two tiny concepts (72 passages each), D1 only."""
    base = dict(model=str(model), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging", "toxicity"),
                strategies=STRATEGIES, store=store, n_bootstrap=50, torch_threads=1, steering=False)
    return RunConfig(**{**base, **overrides})


def stored_pooling(store: LocalStore, pooled_key: str, layers: list[int]) -> list[str]:
    return [key for key in pooled_keys(pooled_key, layers) if store.exists(key)]


def test_dropping_the_vectors_keeps_every_record_and_a_rerun_pools_nothing(
        tiny_llama_dir, local_ray, cache, tmp_path):
    keep = run_benchmark(config(tiny_llama_dir, str(tmp_path / "keep")))
    events: list[RunEvent] = []
    cfg = config(tiny_llama_dir, str(tmp_path / "drop"), drop_pooled=True)
    drop = run_benchmark(cfg, events.append)

    assert [r.to_dict() for r in drop.records] == [r.to_dict() for r in keep.records]
    assert drop.passage_scores.equals(keep.passage_scores)
    assert drop.computed == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0, "pooled_dropped": 2}
    kept, dropped = LocalStore(tmp_path / "keep"), LocalStore(tmp_path / "drop")
    for concept, artifacts in keep.artifacts.items():
        pooled = artifacts["pooled"]
        # the keeping run stored a shard, a head table and a gradient table a layer and the manifest: all gone here
        assert len(stored_pooling(kept, pooled, keep.layers)) == 1 + 3 * len(keep.layers)
        assert stored_pooling(dropped, pooled, keep.layers) == []
        assert dropped.exists(artifacts["d1"]) and dropped.exists(passage_scores_key(artifacts["d1"]))
        assert drop.artifacts[concept] == {**artifacts, "pooled": None}
    assert keep.steerability is not None and drop.steerability is None  # it reads the vectors
    [room] = [e for e in events if isinstance(e, PoolingRoom)]
    free = shutil.disk_usage(tmp_path).free
    assert room.room == int(ROOM_SHARE * room.free) and abs(room.free - free) < 2**30
    assert "(--drop-pooled); the pooling runs ahead of D1 as far as" in room.line

    replayed: list[RunEvent] = []
    again = run_benchmark(cfg, replayed.append)
    assert again.computed == {"pooled": 0, "d1": 0, "pooled_skipped": 2, "d1_skipped": 2}
    assert not any(isinstance(e, ConceptProgress) for e in replayed)
    assert [r.to_dict() for r in again.records] == [r.to_dict() for r in keep.records]


@pytest.mark.parametrize("overlap", [None, True])
def test_with_room_for_one_concept_the_next_is_pooled_only_once_the_last_ones_vectors_left(
        tiny_llama_dir, local_ray, cache, tmp_path, monkeypatch, overlap):
    """A disk with room for 1.5 concepts' vector files (the test's disk holds only them; the room is read from it
    at each decision): on a CPU (probes held until the pooling is done) the gate's held probes start while the
    pooling waits, and with --overlap they run beside it; either way, when a concept's pooling is reported, no other
    concept's vectors are in the store. Without the room gate the CPU's order fails this (both concepts pooled
    before either is probed); beside the forward it holds by the gate alone where the probes outlast the pooling."""
    store = LocalStore(tmp_path / "store")
    cfg = config(tiny_llama_dir, str(store.root), drop_pooled=True, overlap=overlap, reliability=False,
                 concept_group_tokens=0)
    kept = run_benchmark(cfg.model_copy(update={"drop_pooled": False, "store": str(tmp_path / "kept")}))
    keys = {concept: artifacts["pooled"] for concept, artifacts in kept.artifacts.items()}
    every_file = [key for pooled in keys.values() for key in pooled_keys(pooled, [0, 1])]
    concept_files = LocalStore(tmp_path / "kept").stored_bytes(pooled_keys(keys["hedging"], [0, 1]))
    capacity = int(1.5 * concept_files / ROOM_SHARE)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(
        free=capacity - store.stored_bytes(every_file)))
    in_store_when_pooled: dict[str, list[str]] = {}
    order: list[str] = []

    def watch(event: RunEvent) -> None:
        if isinstance(event, ConceptPooled | ConceptProbed):
            order.append(f"{type(event).__name__} {event.concept}")
        if isinstance(event, ConceptPooled):
            in_store_when_pooled[event.concept] = [
                plan for plan in ("hedging", "toxicity") if stored_pooling(store, keys[plan], [0, 1])]

    outcome = run_benchmark(cfg, watch)
    assert outcome.computed["pooled"] == 2 and outcome.computed["pooled_dropped"] == 2
    assert order == ["ConceptPooled hedging", "ConceptProbed hedging", "ConceptPooled toxicity",
                     "ConceptProbed toxicity"]
    assert in_store_when_pooled == {"hedging": ["hedging"], "toxicity": ["toxicity"]}
    assert [r.to_dict() for r in outcome.records] == [r.to_dict() for r in kept.records]


def test_a_resumed_run_probes_what_was_left_and_pools_only_the_layers_whose_d1_is_missing(tiny_llama_dir, local_ray,
                                                                                         cache, tmp_path):
    """Stopped after toxicity's layer-0 D1 landed, its vectors still stored: the rerun pools nothing, probes layer 1,
    gathers and drops. Its layer-1 D1 lost after the drop (quarantined, say): the rerun pools layer 1 alone."""
    strategies = ("A1_mean", "P1_last")
    kept = run_benchmark(config(tiny_llama_dir, str(tmp_path / "kept"), strategies=strategies))
    source = LocalStore(tmp_path / "kept")
    store = LocalStore(tmp_path / "store")
    cfg = config(tiny_llama_dir, str(store.root), strategies=strategies, drop_pooled=True)
    run_benchmark(cfg)
    pooled, d1 = kept.artifacts["toxicity"]["pooled"], kept.artifacts["toxicity"]["d1"]
    unprobed = (d1, passage_scores_key(d1), layer_shard_key(d1, 1), passage_scores_key(layer_shard_key(d1, 1)))
    pooled_layers: list[list[int]] = []

    def watch(event: RunEvent) -> None:
        if isinstance(event, ConceptPooled) and not event.skipped:
            pooled_layers.append([layer for layer in (0, 1) if store.exists(layer_shard_key(pooled, layer))])

    for key in unprobed:
        store.delete(key)
    for key in stored_pooling(source, pooled, [0, 1]):  # toxicity's vectors as the stopped run left them
        if key == pooled:
            store.put_json(key, source.get_json(key))
        else:
            store.put_table(key, source.get_table(key))
    resumed = run_benchmark(cfg, watch)
    assert resumed.computed == {"pooled": 0, "d1": 1, "pooled_skipped": 2, "d1_skipped": 1, "pooled_dropped": 1}
    assert pooled_layers == [] and stored_pooling(store, pooled, [0, 1]) == []
    assert [r.to_dict() for r in resumed.records] == [r.to_dict() for r in kept.records]

    for key in unprobed:
        store.delete(key)
    resumed = run_benchmark(cfg, watch)
    assert resumed.computed == {"pooled": 1, "d1": 1, "pooled_skipped": 1, "d1_skipped": 1, "pooled_dropped": 1}
    assert pooled_layers == [[1]] and stored_pooling(store, pooled, [0, 1]) == []
    assert [r.to_dict() for r in resumed.records] == [r.to_dict() for r in kept.records]


@pytest.mark.parametrize("disk", ["ample", "short"])
def test_concepts_pooled_a_layer_a_pass_drop_their_vectors_and_keep_every_record(
        tiny_llama_dir, local_ray, cache, tmp_path, monkeypatch, disk):
    """The host's memory cuts each concept's pooling into one pass a layer (host_room.py): the first concept's
    passes start together (its D1 needs both before any ratio is known). On a short disk, the second concept's
    first pass fits its room and its second does not while the first's files are there: with nothing running
    that could free room, the driver starts it anyway (RoomGate.force) instead of ending with a concept unprobed."""
    kept = run_benchmark(config(tiny_llama_dir, str(tmp_path / "kept")))
    keys = {concept: artifacts["pooled"] for concept, artifacts in kept.artifacts.items()}
    source = LocalStore(tmp_path / "kept")
    held, copied = ExtractorWorker(str(tiny_llama_dir)).host_bytes_per_passage_layer(list(STRATEGIES), "float32",
                                                                                      False)
    monkeypatch.setattr(concept_pass, "extractor_budget", lambda rooms: (held + copied) * 72 + JOB_FIXED)
    store = LocalStore(tmp_path / "store")
    if disk == "short":  # the test's disk holds only the vector files; the ratios are those the keeping run's show
        count = ExtractorWorker(str(tiny_llama_dir)).stored_bytes_per_passage_layer(list(STRATEGIES),
                                                                                    "float32") * 72  # a layer
        scale = source.stored_bytes(pooled_keys(keys["hedging"], [0, 1])) / (2 * count)
        d1 = kept.artifacts["hedging"]["d1"]
        d1_scale = source.stored_bytes(concept_pass.d1_keys(d1, [0, 1])) / (2 * count)
        fits_first = count * (scale + d1_scale) / ROOM_SHARE  # toxicity's layer 0, nothing on the disk
        fits_second = (count * scale + 2 * count * d1_scale) / ROOM_SHARE + count * scale  # its layer 1 then
        capacity = int((fits_first + fits_second) / 2)
        every_file = [key for pooled in keys.values() for key in pooled_keys(pooled, [0, 1])]
        real_usage = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(
            free=capacity - store.stored_bytes(every_file)))
    forced: list[list[str]] = []
    real_force = RoomGate.force
    monkeypatch.setattr(RoomGate, "force", lambda gate: forced.append(real_force(gate)) or forced[-1])
    dropped = run_benchmark(config(tiny_llama_dir, str(store.root), drop_pooled=True))
    assert dropped.computed["pooled_in_passes"] == 2 and dropped.computed["pooled_dropped"] == 2
    assert [r.to_dict() for r in dropped.records] == [r.to_dict() for r in kept.records]
    assert all(stored_pooling(store, pooled, [0, 1]) == [] for pooled in keys.values())
    assert len(forced) == (1 if disk == "short" else 0)


def test_dropping_the_vectors_with_steering_on_stops_before_any_model_loads(tmp_path) -> None:
    cfg = config(tmp_path / "no-model-here", str(tmp_path / "store"), steering=True, drop_pooled=True)
    with pytest.raises(PoolBenchError) as err:
        run_benchmark(cfg)
    assert str(err.value) == ("--drop-pooled: the steering stage reads the pooled vectors the drop takes; add "
                              "--no-steering (or keep them: --keep-pooled)")
    assert not (tmp_path / "store").exists()
