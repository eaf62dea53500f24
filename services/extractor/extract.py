"""Extraction core: tokenize once, bucket by length, one hooked forward per batch, ActivationBatch out."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from poolbench.corpus.passage import Passage
from poolbench.errors import PoolBenchError

from .activations import ActivationBatch
from .attention_capture import (
    capture_attention,
    gradient_layer_outputs,
    passage_log_likelihood,
)
from .batching import (
    TokenCosts,
    default_max_batch_tokens,
    free_memory_bytes,
    plan_batches,
    row_chunks,
    rows_per_forward,
    token_costs,
)
from .hook_points import capture_layer_outputs

logger = logging.getLogger(__name__)


class ExtractionError(PoolBenchError):
    """A tokenizer or model that extraction cannot work with."""


@dataclass
class TokenizedPassages:
    """Every passage tokenized once, unpadded; offsets already (0, 0) on special tokens."""

    ids: list[str]
    texts: list[str]
    input_ids: list[list[int]]
    offsets: list[list[tuple[int, int]]]
    special: list[list[bool]]

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


@dataclass
class PaddedBatch:
    """One planned batch as numpy arrays; `indices` point into the passages it was cut from."""

    indices: list[int]
    passage_ids: list[str]
    texts: list[str]
    input_ids: np.ndarray  # [B, T] int64
    attention_mask: np.ndarray  # [B, T] bool
    offsets: np.ndarray  # [B, T, 2] int32
    special_mask: np.ndarray  # [B, T] bool, never True on padding

    def select(self, rows: slice) -> PaddedBatch:
        """A chunk of this batch's rows at the same padded length, so every row sees exactly the same forward."""
        return PaddedBatch(self.indices[rows], self.passage_ids[rows], self.texts[rows], self.input_ids[rows],
                           self.attention_mask[rows], self.offsets[rows], self.special_mask[rows])

    @property
    def left_padded(self) -> bool:
        """True when some row has padding before its first real token."""
        mask = self.attention_mask
        return bool((~mask[:, 0] & mask.any(axis=1)).any())


@dataclass
class ExtractionStats:
    """Counters a bench reads: real tokens vs padded tokens, and where the time went."""

    batches: int = 0
    passages: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    forward_seconds: float = 0.0
    convert_seconds: float = 0.0
    pool_seconds: float = 0.0  # inside the capture's sinks (launching device pooling), a pooler's to fill
    transfer_seconds: float = 0.0  # waiting for pooled vectors (or token states) to reach the host
    prepare_seconds: float = 0.0  # making chunks' sinks ready on the host (text extras, weights), either thread
    prepared_ahead: int = 0  # chunks whose preparation ran on the background thread, beside an earlier forward
    skipped: list[tuple[str, int]] = field(default_factory=list)  # (passage id, tokens) too big for the device
    skipped_indices: list[int] = field(default_factory=list)  # the same passages' indices in the batches' plan


def tokenize_passages(
    tokenizer, texts: Sequence[str], ids: Sequence[str], max_length: int
) -> TokenizedPassages:
    """Tokenize all texts in one call with character offsets (needs a fast tokenizer), cut at max_length."""
    if not getattr(tokenizer, "is_fast", False):
        raise ExtractionError(f"tokenizer {type(tokenizer).__name__} is not fast; character offsets need one")
    if len(texts) != len(ids):
        raise ExtractionError(f"{len(texts)} texts but {len(ids)} passage ids")
    encoded = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_length,
        padding=False,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
    )
    special = [[bool(flag) for flag in row] for row in encoded["special_tokens_mask"]]
    offsets = [
        [(0, 0) if flag else (int(start), int(end)) for (start, end), flag in zip(row, flags, strict=True)]
        for row, flags in zip(encoded["offset_mapping"], special, strict=True)
    ]
    input_ids = [list(row) for row in encoded["input_ids"]]
    return TokenizedPassages(list(ids), list(texts), input_ids, offsets, special)


def pad_batch(tokens: TokenizedPassages, indices: Sequence[int], pad_id: int, side: str) -> PaddedBatch:
    """Pad the chosen passages to the batch's longest, on `side` ("left" or "right")."""
    if side not in ("left", "right"):
        raise ExtractionError(f"tokenizer padding_side {side!r}; expected 'left' or 'right'")
    length = max((len(tokens.input_ids[i]) for i in indices), default=0)
    batch = len(indices)
    input_ids = np.full((batch, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=bool)
    offsets = np.zeros((batch, length, 2), dtype=np.int32)
    special_mask = np.zeros((batch, length), dtype=bool)
    for row, index in enumerate(indices):
        n = len(tokens.input_ids[index])
        span = slice(length - n, length) if side == "left" else slice(0, n)
        input_ids[row, span] = tokens.input_ids[index]
        attention_mask[row, span] = True
        if n:
            offsets[row, span] = tokens.offsets[index]
            special_mask[row, span] = tokens.special[index]
    return PaddedBatch(
        list(indices),
        [tokens.ids[i] for i in indices],
        [tokens.texts[i] for i in indices],
        input_ids,
        attention_mask,
        offsets,
        special_mask,
    )


def _texts_and_ids(
    passages: Sequence[Passage] | Sequence[str], ids: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    if all(isinstance(p, Passage) for p in passages):
        if ids is not None:
            raise ExtractionError("give ids only with plain texts; Passage objects carry their own")
        return [p.text for p in passages], [p.id for p in passages]  # type: ignore[union-attr]
    texts = [str(p) for p in passages]
    return texts, [str(i) for i in ids] if ids is not None else [str(i) for i in range(len(texts))]


def prepare_batches(
    tokenizer,
    passages: Sequence[Passage] | Sequence[str],
    *,
    ids: Sequence[str] | None = None,
    batch_size: int = 32,
    max_tokens: int | None = None,
    max_length: int = 256,
) -> list[PaddedBatch]:
    """Tokenize once and pad every length bucket, on the tokenizer's padding side, ready for the forward."""
    texts, passage_ids = _texts_and_ids(passages, ids)
    return pad_batches(tokenizer, tokenize_passages(tokenizer, texts, passage_ids, max_length),
                       batch_size=batch_size, max_tokens=max_tokens)


def pad_batches(tokenizer, tokens: TokenizedPassages, *, batch_size: int = 32,
                max_tokens: int | None = None) -> list[PaddedBatch]:
    """Every length bucket of already tokenized passages, padded on the tokenizer's padding side."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # any id works under a zero attention mask
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    side = getattr(tokenizer, "padding_side", "right")
    return [
        pad_batch(tokens, indices, pad_id, side)
        for indices in plan_batches(tokens.lengths, batch_size, max_tokens)
    ]


def _model_inputs(model: nn.Module, batch: PaddedBatch) -> dict[str, torch.Tensor | bool]:
    """Tensors on the model's device. Left-padded batches get positions counted from each row's first real
    token, as generate() does, so real tokens sit where they would unpadded (transformers 5 forwards
    default to arange(T) whatever the mask). Offset-position models (RoBERTa) need right padding, their
    tokenizers' default."""
    device = next(model.parameters()).device
    accepted = inspect.signature(model.forward).parameters
    mask = torch.from_numpy(batch.attention_mask).to(device=device, dtype=torch.long)
    inputs: dict[str, torch.Tensor | bool] = {
        "input_ids": torch.from_numpy(batch.input_ids).to(device),
        "attention_mask": mask,
        "output_hidden_states": False,
    }
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    if batch.left_padded and "position_ids" in accepted:
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return inputs


def _sync(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_dtype(dtype_out: np.dtype | type) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype_out)).dtype


def model_token_costs(model: nn.Module, layers: Sequence[int], needs: Collection[str],
                      dtype_out: np.dtype | type = np.float32) -> TokenCosts:
    """The budget's per-token bytes for this model's shape and dtype."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    parameter = next(model.parameters())
    return token_costs(
        hidden_size=hidden, intermediate_size=int(getattr(text, "intermediate_size", 0) or 4 * hidden),
        n_heads=int(getattr(text, "num_attention_heads", 1) or 1), vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        n_layers=int(getattr(text, "num_hidden_layers", 0) or max(layers) + 1), layers=layers,
        itemsize=parameter.element_size(), out_itemsize=np.dtype(dtype_out).itemsize, needs=needs)


def resolve_max_batch_tokens(model: nn.Module, layers: Sequence[int], max_batch_tokens: int | None,
                             dtype_out: np.dtype | type = np.float32) -> int:
    """The budget a run names, or the default from the model's device's free memory now."""
    if max_batch_tokens is not None:
        if max_batch_tokens < 1:
            raise ExtractionError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        return int(max_batch_tokens)
    plain = model_token_costs(model, layers, frozenset(), dtype_out).plain
    return default_max_batch_tokens(free_memory_bytes(next(model.parameters()).device), plain)


LayerExtras = Mapping[str, torch.Tensor]


class LayerSink(Protocol):
    """What a capture hands each requested layer to: its token states [B, T, d] on the model's device and that
    layer's extras on the same device ("attention_head_inflow" / "attention_head_inflow_last" [B, H, T],
    "attention_head_output_last" [B, H, Dh], "gradient_norm" / "gradient_x_input" [B, T]); `finish` runs once
    after the forward (and backward), where device work may be waited for."""

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None: ...

    def finish(self) -> None: ...


SinkT = TypeVar("SinkT", bound=LayerSink)


class HostCapture:
    """Today's hand-off, kept as the reference: every layer's token states into one buffer, then to the host as
    an ActivationBatch (numpy) for numpy pooling, activation dumps and other readers of token states."""

    def __init__(self, batch: PaddedBatch, layers: Sequence[int], dtype_out: np.dtype | type = np.float32) -> None:
        self.batch = batch
        self.layers = tuple(layers)
        self._dtype = _torch_dtype(dtype_out)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._buffer: torch.Tensor | None = None
        self._extras: dict[int, LayerExtras] = {}
        self.activations: ActivationBatch | None = None

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        if self._buffer is None:
            self._buffer = torch.empty((len(self.layers), *hidden.shape), dtype=self._dtype, device=hidden.device)
        self._buffer[self._position[layer]].copy_(hidden)
        self._extras[layer] = extras

    def finish(self) -> None:
        assert self._buffer is not None
        b = self.batch
        self.activations = ActivationBatch(
            passage_ids=b.passage_ids, texts=b.texts, layers=self.layers, hidden=self._buffer.cpu().numpy(),
            attention_mask=b.attention_mask, input_ids=b.input_ids, offsets=b.offsets, special_mask=b.special_mask,
            extras=stack_layer_extras([self._extras[layer] for layer in self.layers]))
        self._buffer = None


def stack_layer_extras(per_layer: Sequence[LayerExtras]) -> dict[str, np.ndarray]:
    """Per-layer device extras stacked to the [L, ...] numpy extras strategies read, plus S1's head means."""
    if not per_layer or not per_layer[0]:
        return {}
    extras = {name: torch.stack([layer[name] for layer in per_layer]).cpu().numpy() for name in per_layer[0]}
    if "attention_head_inflow" in extras:
        extras["attention_inflow"] = extras["attention_head_inflow"].mean(axis=2)
        extras["attention_inflow_last"] = extras["attention_head_inflow_last"].mean(axis=2)
    return extras


def extract_batches(
    model: nn.Module,
    decoder_layers: Sequence[nn.Module],
    batches: Iterable[PaddedBatch],
    layers: Sequence[int],
    *,
    dtype_out: np.dtype | type = np.float32,
    stats: ExtractionStats | None = None,
    stop_early: bool = True,
    needs: Collection[str] = frozenset(),
    max_batch_tokens: int | None = None,
) -> Iterator[ActivationBatch]:
    """Capture every requested layer in one forward per row chunk of each batch; stops after the deepest one.

    `max_batch_tokens` bounds a forward (default: from free memory, see batching.py): a batch is cut into
    chunks of its rows at the same padded length, so chunks hold exactly what the whole batch would, and one
    ActivationBatch comes out per chunk. Attention and S2 shrink the chunk to the same bytes.

    `needs` (the union of the pooled strategies' needs) adds extras computed in that same forward and only
    then: "attention" -> attention_inflow / attention_inflow_last [L,B,T] and their per-head forms
    attention_head_inflow / attention_head_inflow_last [L,B,H,T]; with "labels" also
    attention_head_output_last [L,B,H,Dh]; "gradient" -> gradient_norm / gradient_x_input [L,B,T] (the forward
    then runs to the LM head with grad enabled and one backward serves all layers). Without "gradient" no
    graph is built and no LM head runs.
    """
    layers = tuple(int(layer) for layer in layers)
    for _, capture in capture_chunks(model, decoder_layers, batches, layers,
                                     sink_for=lambda chunk: HostCapture(chunk, layers, dtype_out), stats=stats,
                                     stop_early=stop_early, needs=needs, max_batch_tokens=max_batch_tokens,
                                     dtype_out=dtype_out):
        assert capture.activations is not None
        yield capture.activations


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
    """
    if (sink_for is None) == (prepare_for is None):
        raise ExtractionError("capture_chunks needs exactly one of sink_for and prepare_for")
    prepare = prepare_for if prepare_for is not None else partial(_unprepared, sink_for)
    layers = tuple(int(layer) for layer in layers)
    needs = frozenset(needs)
    budget = resolve_max_batch_tokens(model, layers, max_batch_tokens, dtype_out)
    costs = model_token_costs(model, layers, needs, dtype_out)
    plan = _ChunkPlan(iter(batches), costs, budget)
    with _Preparer(prepare, overlap, stats) as preparer:
        while (entry := plan.next()) is not None:
            batch_index, chunk = entry
            sink = None
            try:
                make = preparer.take(chunk)
                upcoming = plan.peek()
                if upcoming is not None:
                    preparer.ahead(upcoming)
                sink = make()
                _capture_chunk(model, decoder_layers, chunk, layers, sink, stats=stats, stop_early=stop_early,
                               needs=needs)
            except torch.OutOfMemoryError:
                sink = None
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
                if "CUDA" not in str(exc) or isinstance(exc, PoolBenchError):
                    raise
                raise ExtractionError(
                    f"CUDA error in the capture (forward and pooling) of batch {batch_index} ({len(chunk.indices)} "
                    f"passages from {chunk.passage_ids[0]!r}, {chunk.input_ids.shape[1]} tokens): "
                    f"{str(exc).splitlines()[0]}") from exc
            yield chunk, sink


def _unprepared(sink_for: Callable[[PaddedBatch], SinkT], chunk: PaddedBatch) -> Callable[[], SinkT]:
    """A sink_for as a prepare_for: nothing to do ahead, everything when the sink is made."""
    return partial(sink_for, chunk)


class _ChunkPlan:
    """The row chunks of the batches in order, each batch cut at the budget when it comes up; after an
    out-of-memory halving every later batch is cut at the smaller size, one already looked at (to prepare its
    first chunk ahead) included."""

    def __init__(self, batches: Iterator[PaddedBatch], costs: TokenCosts, budget: int) -> None:
        self._batches = enumerate(batches)
        self._costs, self._budget = costs, budget
        self._halvings = 0
        self._pending: list[tuple[int, PaddedBatch]] = []
        self._looked: tuple[int, PaddedBatch, int, list[tuple[int, PaddedBatch]]] | None = None  # index, batch,
        # the halvings it was cut at, its chunks

    def _cut(self, index: int, batch: PaddedBatch) -> list[tuple[int, PaddedBatch]]:
        rows = max(1, rows_per_forward(self._costs, self._budget, batch.input_ids.shape[1]) >> self._halvings)
        return [(index, batch.select(chunk)) for chunk in row_chunks(len(batch.indices), rows)]

    def _look(self) -> bool:
        """Cut the next batch (once) without starting it; False at the end."""
        if self._looked is None:
            for index, batch in self._batches:
                self._looked = (index, batch, self._halvings, self._cut(index, batch))
                break
        return self._looked is not None

    def next(self) -> tuple[int, PaddedBatch] | None:
        """The next chunk to capture, or None when every batch is done."""
        while not self._pending:
            if not self._look():
                return None
            assert self._looked is not None
            index, batch, halvings, chunks = self._looked
            self._looked = None
            self._pending = chunks if halvings == self._halvings else self._cut(index, batch)
        return self._pending.pop(0)

    def peek(self) -> PaddedBatch | None:
        """The chunk after the one `next` gave, as it stands now (a halving may still replace it)."""
        if self._pending:
            return self._pending[0][1]
        if not self._look():
            return None
        assert self._looked is not None
        chunks = self._looked[3]
        return chunks[0][1] if chunks else None

    def halve(self, index: int, chunk: PaddedBatch) -> None:
        """Retry `chunk` as its two halves, first; this batch's other chunks keep their size, later ones shrink."""
        self._halvings += 1
        n = len(chunk.indices)
        self._pending[:0] = [(index, chunk.select(slice(0, n // 2))), (index, chunk.select(slice(n // 2, n)))]


class _Preparer:
    """Runs chunks' preparations, the next one on a background thread while a forward runs when `overlap`;
    a preparation made for one chunk object is only ever used for that object."""

    def __init__(self, prepare: Callable[[PaddedBatch], Callable[[], SinkT]], overlap: bool,
                 stats: ExtractionStats | None) -> None:
        self._prepare = prepare
        self._stats = stats
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="poolbench-prepare") if overlap else None
        self._slot: tuple[PaddedBatch, Future] | None = None

    def __enter__(self) -> _Preparer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _timed(self, chunk: PaddedBatch) -> tuple[Callable[[], object], float]:
        start = time.perf_counter()
        make = self._prepare(chunk)
        return make, time.perf_counter() - start

    def take(self, chunk: PaddedBatch) -> Callable[[], SinkT]:
        """`chunk`'s preparation: the one made ahead for this very chunk, else made now."""
        slot, self._slot = self._slot, None
        if slot is not None and slot[0] is chunk:
            make, seconds = slot[1].result()
            if self._stats is not None:
                self._stats.prepared_ahead += 1
        else:
            if slot is not None:
                slot[1].cancel()
            make, seconds = self._timed(chunk)
        if self._stats is not None:
            self._stats.prepare_seconds += seconds
        return make  # type: ignore[return-value]

    def ahead(self, chunk: PaddedBatch) -> None:
        """Start preparing `chunk` in the background (with overlap), to be taken after the current forward."""
        if self._pool is not None and (self._slot is None or self._slot[0] is not chunk):
            if self._slot is not None:
                self._slot[1].cancel()
            self._slot = (chunk, self._pool.submit(self._timed, chunk))


def _release(model: nn.Module) -> None:
    """Give the cached blocks of a failed forward back before the halved retry."""
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.empty_cache()


def _capture_chunk(model: nn.Module, decoder_layers: Sequence[nn.Module], batch: PaddedBatch,
                   layers: tuple[int, ...], sink: LayerSink, *, stats: ExtractionStats | None,
                   stop_early: bool, needs: frozenset[str]) -> None:
    """One forward (and, for S2, one backward) over one chunk; each layer goes to `sink` with its extras."""
    start = time.perf_counter()
    attention, gradient = "attention" in needs, "gradient" in needs
    written: set[int] = set()
    heads: dict[int, dict[str, torch.Tensor]] = {}

    def write(layer: int, hidden: torch.Tensor, more: LayerExtras | None = None) -> None:
        extras = {_ATTENTION_NAMES[name]: value for name, value in heads.get(layer, {}).items()}
        sink(layer, hidden, {**extras, **(more or {})})
        written.add(layer)

    grad_mode = torch.enable_grad() if gradient else torch.inference_mode()
    with grad_mode, ExitStack() as stack:
        inputs = _model_inputs(model, batch)
        mask = inputs["attention_mask"].to(torch.bool)  # type: ignore[union-attr]
        heads = stack.enter_context(
            capture_attention(model, decoder_layers, layers, mask, head_outputs="labels" in needs)
            if attention else nullcontext({}))
        if gradient:
            _gradient_forward(model, decoder_layers, inputs, mask, layers, write)
        else:
            with capture_layer_outputs(decoder_layers, layers, stop_early=stop_early, sink=write):
                model(**inputs)
        missing = [layer for layer in layers if layer not in written]
        if missing:
            raise ExtractionError(f"layers {missing} never ran: decoder_layers are not this model's")
    _sync(model)
    converted = time.perf_counter()
    sink.finish()
    done = time.perf_counter()
    if stats is not None:
        stats.batches += 1
        stats.passages += len(batch.indices)
        stats.tokens += int(batch.attention_mask.sum())
        stats.padded_tokens += batch.attention_mask.size
        stats.forward_seconds += converted - start
        stats.convert_seconds += done - converted


_ATTENTION_NAMES = {"inflow": "attention_head_inflow", "inflow_last": "attention_head_inflow_last",
                    "head_output_last": "attention_head_output_last"}


def _gradient_forward(model: nn.Module, decoder_layers: Sequence[nn.Module], inputs: dict, mask: torch.Tensor,
                      layers: tuple[int, ...], write: Callable[[int, torch.Tensor, LayerExtras], None]) -> None:
    """S2: forward to the LM head with the shallowest requested layer as a grad leaf (the backward stops
    there), and ONE backward of the sum of every row's log-likelihood: rows are independent, so each row's
    share of the gradient is its own gradient."""
    with gradient_layer_outputs(decoder_layers, layers) as captured:
        output = model(**inputs)
    logits = getattr(output, "logits", None)
    if logits is None:
        raise ExtractionError(f"{type(model).__name__} has no LM head: gradient saliency (S2) "
                              "needs a causal LM's log-likelihood")
    score = passage_log_likelihood(logits, inputs["input_ids"], mask)
    del output, logits
    tensors = [captured[layer] for layer in layers]
    grads = torch.autograd.grad(score, tensors)
    with torch.no_grad():
        for layer, hidden, grad in zip(layers, tensors, grads, strict=True):
            write(layer, hidden.detach(), {
                "gradient_norm": torch.linalg.vector_norm(grad.float(), dim=-1),
                "gradient_x_input": (grad.float() * hidden.float()).sum(-1).abs()})


def _count(stats: ExtractionStats, batch: PaddedBatch, seconds: float) -> None:
    stats.batches += 1
    stats.passages += len(batch.indices)
    stats.tokens += int(batch.attention_mask.sum())
    stats.padded_tokens += batch.attention_mask.size
    stats.forward_seconds += seconds


def forward_only(
    model: nn.Module, batches: Iterable[PaddedBatch], *, stats: ExtractionStats | None = None
) -> ExtractionStats:
    """The timing baseline: the plain decoder forward (full depth, final norm, no LM head, no hooks) on the
    same batches under inference_mode, so a hooked path can never look faster than the model it reads."""
    stats = stats if stats is not None else ExtractionStats()
    decoder = getattr(model, "base_model", model)
    for batch in batches:
        start = time.perf_counter()
        with torch.inference_mode():
            decoder(**_model_inputs(decoder, batch))
        _sync(model)
        _count(stats, batch, time.perf_counter() - start)
    return stats


def forward_backward(
    model: nn.Module, batches: Iterable[PaddedBatch], *, max_batch_tokens: int | None = None,
    stats: ExtractionStats | None = None,
) -> ExtractionStats:
    """The S2 baseline: forward to the LM head and one backward of the log-likelihood to the input embeddings,
    in the row chunks S2 itself would use at this budget (a whole batch's graph may not fit)."""
    stats = stats if stats is not None else ExtractionStats()
    layers = (0,)
    budget = resolve_max_batch_tokens(model, layers, max_batch_tokens)
    costs = model_token_costs(model, layers, frozenset({"gradient"}))
    embed = model.get_input_embeddings()
    for batch in batches:
        for chunk in row_chunks(len(batch.indices), rows_per_forward(costs, budget, batch.input_ids.shape[1])):
            part = batch.select(chunk)
            start = time.perf_counter()
            with torch.enable_grad():
                inputs = _model_inputs(model, part)
                ids = inputs.pop("input_ids")
                embeds = embed(ids).detach().requires_grad_(True)  # type: ignore[arg-type]
                logits = model(inputs_embeds=embeds, **inputs).logits
                score = passage_log_likelihood(logits, ids, inputs["attention_mask"].to(torch.bool))  # type: ignore
                torch.autograd.grad(score, [embeds])
            _sync(model)
            _count(stats, part, time.perf_counter() - start)
    return stats


def extract_activations(
    model: nn.Module,
    tokenizer,
    decoder_layers: Sequence[nn.Module],
    passages: Sequence[Passage] | Sequence[str],
    layers: Sequence[int],
    *,
    ids: Sequence[str] | None = None,
    batch_size: int = 32,
    max_tokens: int | None = None,
    max_length: int = 256,
    dtype_out: np.dtype | type = np.float32,
    stats: ExtractionStats | None = None,
    needs: Collection[str] = frozenset(),
    max_batch_tokens: int | None = None,
) -> Iterator[ActivationBatch]:
    """Hidden states at "layers.{L}.out" of every passage, one ActivationBatch per length bucket, in order.

    Tokenizing and planning happen at the call, so a bad tokenizer fails here rather than at the first batch.
    """
    batches = prepare_batches(
        tokenizer, passages, ids=ids, batch_size=batch_size, max_tokens=max_tokens, max_length=max_length
    )
    return extract_batches(model, decoder_layers, batches, layers, dtype_out=dtype_out, stats=stats,
                           needs=needs, max_batch_tokens=max_batch_tokens)
