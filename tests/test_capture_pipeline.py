"""The capture with `overlap` (a GPU's default) keeps the device busy at a job's edges and between its chunks:
the first chunk's forward runs before its pooler is made (its layers kept, the job's text side prepared beside
it), each chunk is finished after the next one is enqueued with no device-wide wait; and (overlap or not) the last
chunk's rows keep its host buffer instead of a copy. On a CPU the order of calls shows it (a CPU runs each op as it
is called, so the overlap itself needs a GPU: the gpu-marked test and bench/extraction_cost.py); the tables are the
same computation either way, so they are compared exactly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import torch
from negation_pairs import passages

import poolbench.extractor.capture as capture
import poolbench.pooler.device_pool as device_pool
from poolbench.extractor.capture import capture_chunks
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.loading import LoadedModel, load_model
from poolbench.extractor.padded_batches import PaddedBatch, prepare_batches
from poolbench.pooler.concept_pooling import ConceptPassages, PooledConcept, pool_concept_group
from poolbench.pooler.device_pool import DevicePooler, HostPooler, prepare_chunk_pooler
from poolbench.pooler.device_staging import DeviceStaging
from poolbench.pooler.gradient_sums import GradientTee
from poolbench.pooler.registry import list_strategies, resolve_strategies

TEXTS = ["one short text", "a second and slightly longer text", "three", "the fourth text is the longest of all",
         "five five", "six is here"]


def _record_calls(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module) -> tuple[list[str], list[int]]:
    """Every forward, pooler made, launched() and finish() of the run in order (F, and M/L/X with the chunk's first
    passage id), and how many times the capture waited for the whole device."""
    events: list[str] = []
    syncs: list[int] = []
    forward = model.forward

    def forward_recorded(*args, **kwargs):
        events.append("F")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_recorded)
    made = DevicePooler.__init__

    def made_recorded(self, specs, chunk, *args, **kwargs):
        events.append(f"M{chunk.passage_ids[0]}")
        made(self, specs, chunk, *args, **kwargs)

    monkeypatch.setattr(DevicePooler, "__init__", made_recorded)
    for name, tag in (("launched", "L"), ("finish", "X")):
        original = getattr(DevicePooler, name)

        def recorded(self, original=original, tag=tag):
            events.append(f"{tag}{self.chunk.passage_ids[0]}")
            return original(self)

        monkeypatch.setattr(DevicePooler, name, recorded)
    monkeypatch.setattr(capture, "sync_device", lambda model: syncs.append(1))
    return events, syncs


def _batches(loaded: LoadedModel) -> list[PaddedBatch]:
    batches = prepare_batches(loaded.tokenizer, TEXTS, ids=[f"p{i}" for i in range(len(TEXTS))], batch_size=2)
    assert len(batches) == 3
    return batches


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("tee", [False, True], ids=["pooler", "gradient_tee"])
def test_with_overlap_the_next_chunk_is_enqueued_before_this_one_is_finished(tiny_llama_dir, monkeypatch,
                                                                             overlap, tee) -> None:
    """Also for S2's GradientTee around the pooler (the sink a run with S2 hands the capture)."""
    loaded = load_model(str(tiny_llama_dir))
    batches = _batches(loaded)
    first = [b.passage_ids[0] for b in batches]
    events, syncs = _record_calls(monkeypatch, loaded.model)
    stats = ExtractionStats()

    def prepare(chunk: PaddedBatch):
        make = prepare_chunk_pooler(list_strategies()[:3], chunk, [0, 1], {}, torch.device("cpu"))
        return (lambda: GradientTee(make(), chunk)) if tee else make

    out = list(capture_chunks(loaded.model, loaded.decoder_layers, batches, [0, 1], stats=stats, overlap=overlap,
                              prepare_for=prepare))
    a, b, c = first
    if overlap:  # the first forward before its pooler is made; chunk k finished only after chunk k+1 is enqueued,
        # and never a device-wide wait
        assert events == ["F", f"M{a}", f"L{a}", f"M{b}", "F", f"L{b}", f"X{a}", f"M{c}", "F", f"L{c}", f"X{b}",
                          f"X{c}"]
        assert syncs == []
    else:  # each chunk made, waited for and finished before the next one starts (launched inside finish)
        assert events == [f"M{a}", "F", f"X{a}", f"L{a}", f"M{b}", "F", f"X{b}", f"L{b}", f"M{c}", "F", f"X{c}",
                          f"L{c}"]
        assert len(syncs) == 3
    assert [chunk.passage_ids for chunk, _ in out] == [b.passage_ids for b in batches]  # in order either way
    poolers = [sink.inner if isinstance(sink, GradientTee) else sink for _, sink in out]
    assert all(p.pooled is not None and p.chunk is chunk for (chunk, _), p in zip(out, poolers, strict=True))
    assert stats.batches == 3 and stats.passages == len(TEXTS)
    assert stats.finished_late == (3 if overlap else 0)


def test_the_first_forward_waits_for_its_pooler_where_its_layers_would_not_fit(tiny_llama_dir, monkeypatch) -> None:
    """The first chunk's layers are kept only within a quarter of the free memory: beyond it, made first."""
    loaded = load_model(str(tiny_llama_dir))
    batches = _batches(loaded)
    a = batches[0].passage_ids[0]
    events, _ = _record_calls(monkeypatch, loaded.model)
    rows, length = batches[0].input_ids.shape
    kept = 2 * rows * length * loaded.hidden_size * 4  # two float32 layers
    for free, first in ((4 * kept, ["F", f"M{a}"]), (4 * kept - 1, [f"M{a}", "F"])):
        monkeypatch.setattr(capture, "free_memory_bytes", lambda device, free=free: free)
        events.clear()
        list(capture_chunks(loaded.model, loaded.decoder_layers, batches, [0, 1], overlap=True, max_batch_tokens=4096,
                            prepare_for=lambda chunk: prepare_chunk_pooler(list_strategies()[:3], chunk, [0, 1], {},
                                                                           torch.device("cpu"))))
        assert events[:2] == first, free


@pytest.mark.parametrize("overlap", [False, True])
def test_a_jobs_text_side_is_made_by_the_first_chunks_preparation(tiny_llama_dir, monkeypatch, overlap) -> None:
    """Its concepts' statistics (concept_text) once, on the preparation thread beside the first forward with
    overlap, on the capture's thread before it without."""
    import threading

    import poolbench.pooler.concept_pooling as concept_pooling

    loaded = load_model(str(tiny_llama_dir))
    threads: list[bool] = []
    text = concept_pooling.concept_text

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return text(*args, **kwargs)

    monkeypatch.setattr(concept_pooling, "concept_text", recorded)
    members = [ConceptPassages("negation", passages(4, "train") + passages(2, "test")),
               ConceptPassages("other", passages(3, "train") + passages(2, "test"))]
    pool_concept_group(loaded, members, [0], resolve_strategies(["A1_mean", "L5_keyword"]), batch_size=2,
                       max_length=48, overlap=overlap)
    assert threads == [not overlap, not overlap]  # one call a concept, for the whole job


@pytest.mark.parametrize("tee", [False, True], ids=["host_pooler", "gradient_tee"])
def test_a_sink_that_cannot_finish_late_is_finished_at_once_and_in_order(tiny_llama_dir, monkeypatch, tee) -> None:
    """The host pooler copies token states with a blocking copy in `finish`: finished late it would wait for the
    next chunk's forward as well (and hold two chunks' token states on the device), so the capture waits for the
    device and finishes it before the next forward; S2's tee around it says so (launched() is False)."""
    loaded = load_model(str(tiny_llama_dir))
    batches = _batches(loaded)
    events, syncs = _record_calls(monkeypatch, loaded.model)
    finished: list[str] = []
    host_finish = HostPooler.finish
    monkeypatch.setattr(HostPooler, "finish", lambda self: (finished.append(self.chunk_id), host_finish(self)))

    def make(chunk: PaddedBatch):
        def sink() -> HostPooler:
            pooler = HostPooler(list_strategies()[:3], chunk, [0], {})
            pooler.chunk_id = chunk.passage_ids[0]  # type: ignore[attr-defined]
            return GradientTee(pooler, chunk) if tee else pooler
        return sink

    out = list(capture_chunks(loaded.model, loaded.decoder_layers, batches, [0], prepare_for=make, overlap=True))
    assert events == ["F", "F", "F"] and finished == [b.passage_ids[0] for b in batches]
    assert len(syncs) == 3 and [chunk.passage_ids for chunk, _ in out] == [b.passage_ids for b in batches]


def _assert_identical(late: PooledConcept, at_once: PooledConcept) -> None:
    """Every table of a concept's pooling, bit for bit: vectors, S3's heads, S2's gradient sums."""
    kinds = [(late.layers, at_once.layers), (late.layer_heads, at_once.layer_heads),
             (late.layer_gradients, at_once.layer_gradients)]
    for tables, expected in kinds:
        if tables is None and expected is None:  # no S2 (or no S3) among the strategies
            continue
        assert tables is not None and expected is not None and list(tables) == list(expected)
        for layer, table in tables.items():
            assert isinstance(table, pa.Table)
            assert table.equals(expected[layer], check_metadata=True), f"layer {layer}"


def test_finishing_late_pools_the_same_tables_bit_for_bit(tiny_llama_dir) -> None:
    """Every strategy (S2's gradient sums through GradientTee.launched, S3's heads), two concepts sharing
    forwards of two rows: the same kernels on the same chunks, only the order of the host's calls differs."""
    loaded = load_model(str(tiny_llama_dir))
    members = [ConceptPassages("negation", passages(6, "train") + passages(3, "test")),
               ConceptPassages("other", [replace(p, concept="other", text=p.text.upper())
                                         for p in passages(4, "train") + passages(2, "test")])]
    specs = resolve_strategies(None)
    assert {s.code for s in specs} >= {"S2", "S3"}
    runs = [pool_concept_group(loaded, members, [0, 1], specs, batch_size=2, max_length=48, overlap=overlap)
            for overlap in (True, False)]
    for late, at_once in zip(*runs, strict=True):
        _assert_identical(late, at_once)
        assert late.layer_gradients is not None
        sums = late.layer_gradients[1].column("gradient_sum").combine_chunks().values.to_numpy()
        assert np.abs(sums).max() > 0  # the gradient sums really came through the late path


@pytest.mark.parametrize("gradient", [False, True], ids=["inference_mode", "with_s2"])
def test_a_staged_pooler_through_the_real_capture_pools_the_same_tables(tiny_llama_dir, monkeypatch,
                                                                         gradient) -> None:
    """The staging a GPU takes by default (device_staging), forced on the CPU through the real capture: without S2
    the forward runs in inference mode, where the staging buffer is made, and `launched` writes the flags into it
    outside (the H200 run of session 35 stopped there: an inference tensor updated in place); with S2, inside the
    backward. Every strategy's tables as unstaged, bit for bit, one copy a chunk."""
    loaded = load_model(str(tiny_llama_dir))
    members = [ConceptPassages("negation", passages(6, "train") + passages(3, "test"))]
    specs = [spec for spec in resolve_strategies(None) if gradient or "gradient" not in spec.needs]
    [plain] = pool_concept_group(loaded, members, [0, 1], specs, batch_size=2, max_length=48, overlap=True)
    monkeypatch.setattr(device_pool, "staged_by_default", lambda device: True)
    sent, launched = [], []
    send, launch = DeviceStaging.send, DevicePooler.launched
    monkeypatch.setattr(DeviceStaging, "send", lambda self, host: sent.append(1) or send(self, host))
    monkeypatch.setattr(DevicePooler, "launched", lambda self: launched.append(1) or launch(self))
    [staged] = pool_concept_group(loaded, members, [0, 1], specs, batch_size=2, max_length=48, overlap=True)
    assert len(sent) == len(launched) >= 5  # one copy a chunk: 9 passages, two rows at most a chunk
    _assert_identical(staged, plain)


def test_gradient_sums_reach_the_host_through_launched(tiny_llama_dir) -> None:
    """GradientTee.launched stacks and copies every layer's sums; finish hands them over as [L, B, d]."""
    loaded = load_model(str(tiny_llama_dir))
    batch = _batches(loaded)[0]
    inner = prepare_chunk_pooler(list_strategies()[:1], batch, [0, 1], {}, torch.device("cpu"))()
    tee = GradientTee(inner, batch)
    hidden = torch.arange(2 * batch.input_ids.shape[1] * 4, dtype=torch.float32).reshape(2, -1, 4)
    for layer in (1, 0):
        tee(layer, torch.zeros(2, batch.input_ids.shape[1], loaded.hidden_size),
            {"gradient_sum": hidden[:, 0, :] + layer})
    tee.launched()
    tee.finish()
    assert tee.layers == (0, 1) and tee.sums is not None and tee.sums.shape == (2, 2, 4)
    assert np.array_equal(tee.sums[1], hidden[:, 0, :].numpy() + 1)  # small integers: exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_finishing_late_waits_for_no_device_and_pools_the_same_tables(tiny_llama_dir, monkeypatch) -> None:
    """S2 left out: attention's backward on CUDA may sum in another order run to run (the CPU test holds S2)."""
    loaded = load_model(str(tiny_llama_dir), device="cuda")
    members = [ConceptPassages("negation", passages(6, "train") + passages(3, "test"))]
    specs = [spec for spec in resolve_strategies(None) if "gradient" not in spec.needs]
    syncs: list[int] = []
    synced = capture.sync_device
    monkeypatch.setattr(capture, "sync_device", lambda model: (syncs.append(1), synced(model)))
    [late] = pool_concept_group(loaded, members, [0, 1], specs, batch_size=2, max_length=48, overlap=True)
    assert syncs == []
    [at_once] = pool_concept_group(loaded, members, [0, 1], specs, batch_size=2, max_length=48, overlap=False)
    assert len(syncs) >= 5
    _assert_identical(late, at_once)


def test_the_last_chunks_rows_keep_its_buffer_and_no_later_chunk_can_take_it(tiny_llama_dir, monkeypatch) -> None:
    """Every chunk but the job's last gives its host buffer back after its rows are copied out; the last hands it
    over: its rows are views of it (no copy after the last forward) and it never returns to the run's buffers."""
    from poolbench.pooler.device_pool import HostBuffers

    loaded = load_model(str(tiny_llama_dir))
    events: list[tuple[str, int]] = []
    handed: list[tuple[int, int]] = []
    give, hand_over = HostBuffers.give, DevicePooler.hand_over
    monkeypatch.setattr(HostBuffers, "give", lambda self, buffer: (events.append(("give", buffer.data_ptr())),
                                                                   give(self, buffer)))

    def handing(self):
        assert self._host is not None
        handed.append((self._host.data_ptr(), self._host.numel() * 4))
        events.append(("hand", self._host.data_ptr()))
        hand_over(self)

    monkeypatch.setattr(DevicePooler, "hand_over", handing)
    member = ConceptPassages("negation", passages(4, "train") + passages(2, "test"))
    [pooled] = pool_concept_group(loaded, [member], [0, 1], resolve_strategies(["A1_mean", "A2_max"]), batch_size=2,
                                  max_length=48, overlap=False, max_batch_tokens=4096)
    import gc
    gc.collect()  # a pooler's buffer goes back by its finalizer too: the handed-over one must not
    chunks = len(events)
    assert chunks >= 3 and events[-1][0] == "hand" and [kind for kind, _ in events[:-1]] == ["give"] * (chunks - 1)
    start, size = handed[0]
    for table in pooled.layers.values():
        inside = [start <= chunk.values.buffers()[1].address < start + size
                  for chunk in table.column("vector").chunks]
        assert inside == ([False] * (chunks - 1) + [True]) * 2  # per strategy: only the last chunk's rows are views
