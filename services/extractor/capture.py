"""The capture loop: one hooked forward per row chunk of each batch, within a token budget read from the
model's shape, each layer handed to a sink as soon as it has run; out-of-memory chunks are halved and retried."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Generic, NoReturn

import numpy as np
import torch
from torch import nn

from poolbench.errors import ExtractionError, PoolBenchError
from poolbench.extractor.attention_capture import capture_attention
from poolbench.extractor.batching import (
    TokenCosts,
    budget_cap,
    default_max_batch_tokens,
    free_memory_bytes,
    row_chunks,
    token_costs,
)
from poolbench.extractor.chunk_plan import ChunkPlan
from poolbench.extractor.chunk_preparer import ChunkPreparer
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.gradient_saliency import gradient_forward
from poolbench.extractor.hook_points import capture_layer_outputs
from poolbench.extractor.layer_sinks import KeptLayers, LaunchedSink, LayerExtras, SinkT
from poolbench.extractor.lm_head_likelihood import real_pairs_from_host
from poolbench.extractor.model_config import attention_heads, text_config
from poolbench.extractor.padded_batches import PaddedBatch, model_inputs
from poolbench.extractor.site_hooks import check_sites, site_module

logger = logging.getLogger(__name__)


def sync_device(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_token_costs(model: nn.Module, layers: Sequence[int], needs: Collection[str],
                      dtype_out: np.dtype | type = np.float32) -> TokenCosts:
    """The budget's per-token bytes for this model's shape, dtype and attention implementation."""
    text = text_config(model)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads, head_dim = attention_heads(model)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    parameter = next(model.parameters())
    return token_costs(
        hidden_size=hidden, intermediate_size=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
        n_heads=heads, vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        n_layers=int(getattr(text, "num_hidden_layers", 0) or max(layers) + 1), layers=layers,
        itemsize=parameter.element_size(), out_itemsize=np.dtype(dtype_out).itemsize, needs=needs,
        kv_size=kv_heads * head_dim, n_kv_heads=kv_heads, head_dim=head_dim,
        eager_attention=getattr(text, "_attn_implementation", None) == "eager")


def resolve_max_batch_tokens(model: nn.Module, layers: Sequence[int], max_batch_tokens: int | None,
                             dtype_out: np.dtype | type = np.float32) -> int:
    """The budget a run names, or the default from the model's device's free memory now, at most its budget_cap."""
    if max_batch_tokens is not None:
        if max_batch_tokens < 1:
            raise ExtractionError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        return int(max_batch_tokens)
    plain = model_token_costs(model, layers, frozenset(), dtype_out).plain
    device = next(model.parameters()).device
    return default_max_batch_tokens(free_memory_bytes(device), plain, cap=budget_cap(device))


def capture_chunks(
    model: nn.Module,
    decoder_layers: Sequence[nn.Module],
    batches: Iterable[PaddedBatch],
    layers: Sequence[int],
    *,
    sink_for: Callable[[PaddedBatch], SinkT] | None = None,
    prepare_for: Callable[[PaddedBatch], Callable[[], SinkT]] | None = None,
    overlap: bool = False,
    stats: ExtractionStats | None = None,
    stop_early: bool = True,
    needs: Collection[str] = frozenset(),
    max_batch_tokens: int | None = None,
    dtype_out: np.dtype | type = np.float32,
    site: str = "residual",
) -> Iterator[tuple[PaddedBatch, SinkT]]:
    """One forward per row chunk; each requested layer goes to the chunk's sink (made by `sink_for` before the
    forward, so its host-side preparation is done and sent ahead) as soon as the layer has run, and the
    (chunk, finished sink) pair comes out. A chunk that runs out of device memory is halved and retried (later
    chunks of the run keep the smaller size); a single passage that does not fit alone is skipped and counted
    in `stats.skipped` as (passage id, tokens). Any other CUDA error stops with one line naming the batch.

    `prepare_for` (instead of `sink_for`) makes a sink in two steps: `prepare_for(chunk)` does the chunk's host
    work and returns the function that makes its sink on this thread. With `overlap`, the next chunk's
    prepare_for runs on a background thread while this chunk's forward runs (torch releases the GIL in its ops);
    a preparation is used only for the very chunk it was made for, never for the halves of a chunk cut after it.
    With `overlap`, a LaunchedSink is also finished one chunk late: the next chunk's forward is enqueued first,
    then this chunk's copies are waited for and it comes out, so the host's work between two chunks (finishing
    one, handing it to its tables, making the next sink, enqueueing its first layers) runs while the device is
    still busy, where a device-wide wait after every chunk left the device idle through it. And the first chunk's
    forward is enqueued before its sink is made, its layers kept (KeptLayers, where they take at most a quarter of
    the free memory) while its preparation runs on the background thread. Chunks come out in order either way,
    with the same values.

    `site` (site_hooks.SITES) is the tensor each layer hands: the block output (residual) or its attention or MLP
    sub-block's output; attention extras (S1, S3) are read from the blocks whatever the site.
    """
    if (sink_for is None) == (prepare_for is None):
        raise ExtractionError("capture_chunks needs exactly one of sink_for and prepare_for")
    prepare = prepare_for if prepare_for is not None else partial(_unprepared, sink_for)
    layers = tuple(int(layer) for layer in layers)
    needs = frozenset(needs)
    budget = resolve_max_batch_tokens(model, layers, max_batch_tokens, dtype_out)
    costs = model_token_costs(model, layers, needs, dtype_out)
    [site] = check_sites([site])
    site_modules = decoder_layers if site == "residual" else \
        [site_module(block, layer, site) for layer, block in enumerate(decoder_layers)]
    free = free_memory_bytes(next(model.parameters()).device) if "gradient" in needs else 0
    plan = ChunkPlan(iter(batches), costs, budget, free)
    in_flight: _InFlight[SinkT] | None = None  # a chunk enqueued, finished after the next one is enqueued (overlap)
    first = overlap and prepare_for is not None  # the first chunk may run before its sink is made (KeptLayers)
    with ChunkPreparer(prepare, overlap, stats) as preparer:
        while (entry := plan.next()) is not None:
            batch_index, chunk = entry
            ahead_of_sink, first = first and _kept_layers_fit(model, chunk, layers, needs), False
            try:
                if ahead_of_sink:
                    launched = _launch_before_its_sink(model, decoder_layers, chunk, layers, batch_index, preparer,
                                                       plan, stop_early=stop_early, needs=needs,
                                                       site_modules=site_modules)
                    sink = launched.sink
                else:
                    sink = _make_sink(preparer, plan, chunk)
                    launched = _launch_chunk(model, decoder_layers, chunk, layers, sink, batch_index,
                                             stop_early=stop_early, needs=needs, site_modules=site_modules,
                                             gradient_rows=plan.gradient_rows(chunk.input_ids.shape[1]))
                # its copies start behind this chunk's work, so it can be finished late
                late = overlap and isinstance(sink, LaunchedSink) and sink.launched()
            except torch.OutOfMemoryError:
                _release(model)
                n = len(chunk.indices)
                if n > 1:
                    plan.halve(batch_index, chunk)
                    continue
                tokens = int(chunk.attention_mask.sum())
                logger.warning("passage %s (%d tokens) does not fit in device memory alone; skipped",
                               chunk.passage_ids[0], tokens)
                if stats is not None:
                    stats.skipped.append((chunk.passage_ids[0], tokens))
                    stats.skipped_indices.append(chunk.indices[0])
                continue
            except RuntimeError as exc:
                _raise_cuda_error(exc, batch_index, chunk)
            if in_flight is not None:  # the chunk before it, while this one runs
                yield _finish_chunk(model, in_flight, stats, late=True)
                in_flight = None
            if late:
                in_flight = launched
            else:  # a sink that cannot finish late is finished at once, after the one before it
                yield _finish_chunk(model, launched, stats, late=False)
        if in_flight is not None:
            yield _finish_chunk(model, in_flight, stats, late=True)


@dataclass
class _InFlight(Generic[SinkT]):
    """A chunk whose forward (and backward) is enqueued: what its finish needs."""

    batch_index: int
    chunk: PaddedBatch
    sink: SinkT
    launch_seconds: float
    checks: Sequence[Callable[[], None]] = ()  # what the launch left to check once its work is done


def _kept_layers_fit(model: nn.Module, chunk: PaddedBatch, layers: tuple[int, ...], needs: frozenset[str]) -> bool:
    """Whether the first chunk's requested layers (states in the model's dtype, attention and gradient extras)
    take at most a quarter of the device's free memory beside its forward."""
    parameter = next(model.parameters())
    heads, _ = attention_heads(model)
    rows, length = chunk.input_ids.shape
    per_token = int(getattr(text_config(model), "hidden_size", 0) or 0) * parameter.element_size()
    per_token += (8 * heads if "attention" in needs else 0) + (8 if "gradient" in needs else 0)
    return len(layers) * rows * length * per_token <= free_memory_bytes(parameter.device) // 4


def _launch_before_its_sink(model: nn.Module, decoder_layers: Sequence[nn.Module], chunk: PaddedBatch,
                            layers: tuple[int, ...], batch_index: int, preparer: ChunkPreparer[SinkT],
                            plan: ChunkPlan, *, stop_early: bool, needs: frozenset[str],
                            site_modules: Sequence[nn.Module]) -> _InFlight[SinkT]:
    """A job's first chunk: its preparation (the job's text-side work, its weights) starts on the background
    thread, its forward is enqueued with the layers kept, and its sink, once made, is handed them. The device
    runs the first forward while the host prepares it, where it waited idle for that preparation before."""
    preparer.ahead(chunk)
    kept = KeptLayers()
    launched = _launch_chunk(model, decoder_layers, chunk, layers, kept, batch_index, stop_early=stop_early,
                             needs=needs, site_modules=site_modules,
                             gradient_rows=plan.gradient_rows(chunk.input_ids.shape[1]))
    start = time.perf_counter()
    sink = _make_sink(preparer, plan, chunk)
    kept.hand_to(sink)
    return _InFlight(batch_index, chunk, sink, launched.launch_seconds + time.perf_counter() - start,
                     launched.checks)


def _make_sink(preparer: ChunkPreparer[SinkT], plan: ChunkPlan, chunk: PaddedBatch) -> SinkT:
    """`chunk`'s sink from its preparation, with the next chunk's preparation started behind it."""
    make = preparer.take(chunk)
    upcoming = plan.peek()
    if upcoming is not None:
        preparer.ahead(upcoming)
    return make()


def _raise_cuda_error(exc: RuntimeError, batch_index: int, chunk: PaddedBatch) -> NoReturn:
    """A CUDA error of the capture as one line naming the batch; any other error as it was."""
    if "CUDA" not in str(exc) or isinstance(exc, PoolBenchError):
        raise exc
    raise ExtractionError(
        f"CUDA error in the capture (forward and pooling) of batch {batch_index} ({len(chunk.indices)} "
        f"passages from {chunk.passage_ids[0]!r}, {chunk.input_ids.shape[1]} tokens): "
        f"{str(exc).splitlines()[0]}") from exc


def _unprepared(sink_for: Callable[[PaddedBatch], SinkT], chunk: PaddedBatch) -> Callable[[], SinkT]:
    """A sink_for as a prepare_for: nothing to do ahead, everything when the sink is made."""
    return partial(sink_for, chunk)


def _release(model: nn.Module) -> None:
    """Give the cached blocks of a failed forward back before the halved retry."""
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()


def _launch_chunk(model: nn.Module, decoder_layers: Sequence[nn.Module], batch: PaddedBatch,
                  layers: tuple[int, ...], sink: SinkT, batch_index: int, *, stop_early: bool,
                  needs: frozenset[str], site_modules: Sequence[nn.Module], gradient_rows: int = 0
                  ) -> _InFlight[SinkT]:
    """One forward (and, for S2, one backward per sub-chunk of `gradient_rows` rows) over one chunk, enqueued; each
    layer's site output (`site_modules[L]`'s output: the block itself for the residual site) goes to `sink` with
    its extras, for the whole chunk at once. Nothing here waits for the device."""
    start = time.perf_counter()
    gradient = "gradient" in needs
    n_rows = len(batch.indices)
    checks: list[Callable[[], None]] = []
    if gradient and 0 < gradient_rows < n_rows:
        parts = [_run_rows(model, decoder_layers, batch.select(rows), layers, needs, site_modules, stop_early,
                           checks=checks) for rows in row_chunks(n_rows, gradient_rows)]
        for layer in layers:
            hidden = torch.cat([part[layer][0] for part in parts])
            sink(layer, hidden, {name: torch.cat([part[layer][1][name] for part in parts])
                                 for name in parts[0][layer][1]})
        del parts
    else:
        _run_rows(model, decoder_layers, batch, layers, needs, site_modules, stop_early, sink=sink, checks=checks)
    return _InFlight(batch_index, batch, sink, time.perf_counter() - start, checks)


def _finish_chunk(model: nn.Module, chunk: _InFlight[SinkT], stats: ExtractionStats | None, *, late: bool
                  ) -> tuple[PaddedBatch, SinkT]:
    """Wait for an enqueued chunk's work and count it. Finished late (a LaunchedSink), `finish` waits for the
    chunk's own event and all of it counts as forward seconds (its own work after the wait is a few views);
    otherwise the whole device is waited for first (the forward's seconds) and `finish` is convert seconds."""
    start = time.perf_counter()
    try:
        if not late:
            sync_device(model)
        waited = time.perf_counter()
        chunk.sink.finish()
        for check in chunk.checks:  # the forward's own checks, read once its work is done (no wait of their own)
            check()
    except RuntimeError as exc:
        _raise_cuda_error(exc, chunk.batch_index, chunk.chunk)
    done = time.perf_counter()
    converted = done if late else waited  # late, the wait is inside finish: all of it forward seconds
    if stats is not None:
        stats.count_forward(chunk.chunk, chunk.launch_seconds + converted - start)
        stats.convert_seconds += done - converted
        stats.finished_late += late
    return chunk.chunk, chunk.sink


def _run_rows(model: nn.Module, decoder_layers: Sequence[nn.Module], batch: PaddedBatch, layers: tuple[int, ...],
              needs: frozenset[str], site_modules: Sequence[nn.Module], stop_early: bool,
              sink: Callable[[int, torch.Tensor, LayerExtras], None] | None = None,
              checks: list[Callable[[], None]] | None = None) -> dict[int, tuple[torch.Tensor, LayerExtras]]:
    """One forward (and S2's backward) over these rows: each layer to `sink` as it comes, or, without a sink,
    every layer's (hidden, extras) returned for the caller to join with its other sub-chunks. Nothing here reads
    the device: S2's log-likelihood terms come from the batch's host mask, and the attention capture's check of the
    mask goes to `checks`, run when the chunk is finished (a read here held the host until the chunk's forward,
    backward and pooling were done, and the device idle while the host then worked between chunks)."""
    attention, gradient = "attention" in needs, "gradient" in needs
    kept: dict[int, tuple[torch.Tensor, LayerExtras]] = {}
    written: set[int] = set()
    heads: dict[int, dict[str, torch.Tensor]] = {}

    def write(layer: int, hidden: torch.Tensor, more: LayerExtras | None = None) -> None:
        extras = {_ATTENTION_NAMES[name]: value for name, value in heads.get(layer, {}).items()}
        extras.update(more or {})
        if sink is not None:
            sink(layer, hidden, extras)
        else:
            kept[layer] = (hidden, extras)
        written.add(layer)

    grad_mode = torch.enable_grad() if gradient else torch.inference_mode()
    with grad_mode, ExitStack() as stack:
        inputs = model_inputs(model, batch)
        mask = inputs["attention_mask"].to(torch.bool)  # type: ignore[union-attr]
        heads = stack.enter_context(
            capture_attention(model, decoder_layers, layers, mask, head_outputs="labels" in needs, checks=checks)
            if attention else nullcontext({}))
        if gradient:
            pairs = real_pairs_from_host(batch.attention_mask, mask.device)
            gradient_forward(model, site_modules, inputs, mask, layers, write, pairs=pairs)
        else:
            with capture_layer_outputs(site_modules, layers, stop_early=stop_early, sink=write):
                model(**inputs)
        missing = [layer for layer in layers if layer not in written]
        if missing:
            raise ExtractionError(f"layers {missing} never ran: decoder_layers are not this model's")
    return kept


_ATTENTION_NAMES = {"inflow": "attention_head_inflow", "inflow_last": "attention_head_inflow_last",
                    "head_output_last": "attention_head_output_last"}
