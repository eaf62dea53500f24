"""Pooling inside the capture: each layer's token states are pooled by torch on the model's device as the layer
runs, and only pooled vectors [S, B, d] leave it (pinned host buffers, non-blocking copies on CUDA).

What the strategies need from the text (masks, windows, positions, parses, corpus statistics) becomes one
weight tensor per chunk on the CPU before the forward and is sent once. What depends on the layer is computed
on the device per layer: token norms (A4 and the sink rule), attention inflow (S1, S3's heads), gradients (S2),
the sink rule itself (poolbench.pooler.sink, with numpy's median) and the max/min reductions. The same code
runs on CPU and GPU; `pool_tokens` (numpy hand-off, pool.py) is its reference twin. A weight rule that reads
token states itself (a plugin using ctx.hidden) sends its chunk the reference way (HostPooler).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.layer_sinks import HostCapture, LayerExtras
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.aggregation import norm_weights
from poolbench.pooler.iti import head_vectors, selects_heads
from poolbench.pooler.pool import PooledBatch, check_pool_inputs, checked_weights, pool_tokens
from poolbench.pooler.reference import NORM_EPS, inverse_norm_weights
from poolbench.pooler.saliency import (
    attention_inflow_weights,
    attention_last_query_weights,
    gradient_norm_weights,
    gradient_x_input_weights,
)
from poolbench.pooler.sink import AUTO_OTHERS, SINK_RATIO, uniform_causal_inflow
from poolbench.pooler.spec import HiddenOnDevice, StrategySpec, TokenContext

# weight rules whose values exist only on the device, per layer: rule -> what the device path reads instead
LAYER_WEIGHTS = {
    norm_weights: "token_norms",
    inverse_norm_weights: "inverse_token_norms",
    attention_inflow_weights: "attention_inflow",
    attention_last_query_weights: "attention_inflow_last",
    gradient_norm_weights: "gradient_norm",
    gradient_x_input_weights: "gradient_x_input",
}
LAYER_EXTRAS = frozenset({"attention_inflow", "attention_inflow_last", "attention_head_inflow",
                          "attention_head_inflow_last", "attention_head_output_last", "gradient_norm",
                          "gradient_x_input"})


class _HostExtras(Mapping):
    """The chunk's host extras (parses, corpus statistics); the per-layer ones exist only on the device."""

    def __init__(self, extras: Mapping[str, np.ndarray]) -> None:
        self._extras = dict(extras)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in LAYER_EXTRAS:
            raise HiddenOnDevice(f"extras[{name!r}]")
        return self._extras[name]

    def __iter__(self):
        return iter([*self._extras, *LAYER_EXTRAS])

    def __len__(self) -> int:
        return len(self._extras) + len(LAYER_EXTRAS)

    def __contains__(self, name: object) -> bool:
        return name in LAYER_EXTRAS or name in self._extras


def _numpy_median(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B] median over the kept entries of each row as np.nanmedian gives it (mean of the two middle values
    for an even count; NaN where nothing is kept); torch.nanmedian takes the lower one instead."""
    n = keep.sum(dim=-1)
    ordered = torch.where(keep, values, torch.full_like(values, float("inf"))).sort(dim=-1).values
    low = ordered.gather(-1, ((n - 1).clamp(min=0) // 2)[:, None]).squeeze(-1)
    high = ordered.gather(-1, (n // 2).clamp(max=values.shape[-1] - 1)[:, None]).squeeze(-1)
    return torch.where(n > 0, (low + high) / 2, torch.full_like(low, float("nan")))


@dataclass(frozen=True)
class HostWeights:
    """What a DevicePooler sends to the device, built on the CPU from the chunk and its text extras alone: the
    part of a chunk's preparation that may run ahead of the forward (on another thread), pinned for an async
    send on CUDA."""

    sources: tuple[str | int, ...]  # per spec: a LAYER_WEIGHTS name, "max"/"min", or an index into `static`
    static: torch.Tensor | None  # [L or 1, S_static, B, T] float32
    mask: torch.Tensor  # [B, T] bool
    first: torch.Tensor  # [B, T] bool, each passage's first real token
    first_index: torch.Tensor  # [B, 1] int64
    lengths: torch.Tensor  # [B] int64
    uniform: dict[str, torch.Tensor]  # per attention query kind: sink.uniform_causal_inflow [B, T]


def host_weights(specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray], *, pin: bool = False) -> HostWeights:
    """Every static weight rule run on the chunk (raises HiddenOnDevice when one reads token states), and the
    masks the per-layer rules need; `pin` puts them in page-locked memory so the send does not wait."""
    mask = np.asarray(chunk.attention_mask, dtype=bool)
    check_pool_inputs(chunk.passage_ids, mask.sum(axis=1), specs)
    ctx = TokenContext.from_arrays(attention_mask=mask, special_mask=chunk.special_mask, offsets=chunk.offsets,
                                   input_ids=chunk.input_ids, texts=chunk.texts, passage_ids=chunk.passage_ids,
                                   extras=_HostExtras(host_extras))
    sources: list[str | int] = []
    static: list[np.ndarray] = []
    for spec in specs:
        if spec.kind == "reduction":
            sources.append(str(spec.reduction))
        elif spec.weights_fn in LAYER_WEIGHTS:
            sources.append(LAYER_WEIGHTS[spec.weights_fn])
        else:  # raises HiddenOnDevice when the rule reads token states: the caller pools on the host
            sources.append(len(static))
            static.append(checked_weights(spec, ctx, len(layers)))

    def host(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.pin_memory() if pin else tensor

    stacked = None
    if static:
        stacked = host(np.asarray(np.stack([np.broadcast_to(w, (len(layers), *mask.shape)) for w in static], axis=1)
                                  if any(w.ndim == 3 for w in static) else np.stack(static)[None], dtype=np.float32))
    first = mask.argmax(axis=1)
    onehot = np.zeros_like(mask)
    onehot[np.arange(len(first)), first] = True
    queries = {spec.attention_queries for spec in specs
               if spec.attention_queries is not None and spec.sink_mode == "auto"}
    return HostWeights(tuple(sources), stacked, host(mask), host(onehot), host(first[:, None]),
                       host(mask.sum(axis=1)), {q: host(uniform_causal_inflow(mask, q)) for q in sorted(queries)})


class DevicePooler:
    """A capture sink for one chunk: pools every strategy at each layer on the layer's device, keeps nothing of
    the token states, and after `finish` holds `pooled` (a PooledBatch) and, for supervised strategies, `heads`
    (per-head pooled vectors [L, B, H, d] and last-token head outputs [L, B, H, Dh]). `weights` are the chunk's
    HostWeights when they were built ahead (else built here)."""

    def __init__(self, specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray], device: torch.device,
                 weights: HostWeights | None = None) -> None:
        self.specs = list(specs)
        self.chunk = chunk
        self.layers = tuple(int(layer) for layer in layers)
        self.device = torch.device(device)
        self.pool_seconds = 0.0
        self.transfer_seconds = 0.0
        self.activations: ActivationBatch | None = None
        if weights is None:
            weights = host_weights(self.specs, chunk, self.layers, host_extras)
        self._sources = list(weights.sources)
        self._supervised = any(selects_heads(spec) for spec in self.specs)
        send = {"device": self.device, "non_blocking": True}
        self._mask = weights.mask.to(**send)
        self._maskf = self._mask.float()
        self._first = weights.first.to(**send)
        self._first_index = weights.first_index.to(**send)
        self._others = self._mask & ~self._first
        self._lengths = weights.lengths.to(**send)
        self._static = weights.static.to(**send) if weights.static is not None else None
        self._uniform = {q: values.to(**send) for q, values in weights.uniform.items()}
        self._norms_needed = any(s in ("token_norms", "inverse_token_norms") for s in self._sources) or any(
            spec.sink_mode != "keep" for spec in self.specs)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._by_count = [spec.divide_by == "token_count" for spec in self.specs]
        batch = int(weights.mask.shape[0])
        self._fallback = torch.zeros((len(self.specs), batch), dtype=torch.bool, device=self.device)
        self._bad = torch.zeros(len(self.specs), dtype=torch.bool, device=self.device)
        self._out: torch.Tensor | None = None
        self._masked: torch.Tensor | None = None
        self._head_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pooled: PooledBatch | None = None
        self.heads: tuple[np.ndarray, np.ndarray] | None = None

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, pin_memory=self.device.type == "cuda")

    def _sink_rows(self, norms: torch.Tensor, mode: str) -> torch.Tensor:
        """[B] the sink rule (sink.sink_rows) at this layer."""
        if mode == "keep":
            return torch.zeros_like(self._lengths, dtype=torch.bool)
        if mode == "skip":
            return self._lengths >= 2
        first_norm = norms.gather(1, self._first_index).squeeze(1)
        ratio = first_norm / _numpy_median(norms, self._others)
        return (self._lengths > AUTO_OTHERS) & (ratio >= SINK_RATIO)

    def _attention_sink_rows(self, weights: torch.Tensor, queries: str) -> torch.Tensor:
        """[B] sink.attention_sink_rows at this layer, in float64 as there."""
        uniform = self._uniform[queries]
        relative = torch.where(self._mask, weights.double() / torch.where(self._mask, uniform, 1.0),
                               torch.full_like(uniform, float("nan")))
        first = relative.gather(1, self._first_index).squeeze(1)
        ratio = first / _numpy_median(relative, self._others)
        return (self._lengths > AUTO_OTHERS) & (ratio >= SINK_RATIO)

    def _layer_weights(self, source: str, norms: torch.Tensor | None, extras: LayerExtras) -> torch.Tensor:
        if source == "token_norms":
            assert norms is not None
            return norms
        if source == "inverse_token_norms":
            assert norms is not None
            return 1.0 / (norms + NORM_EPS)
        if source in ("attention_inflow", "attention_inflow_last"):
            name = "attention_head_inflow" if source == "attention_inflow" else "attention_head_inflow_last"
            if name not in extras:
                raise StrategyError(f"batch has no extras[{source!r}]: this strategy needs 'attention' at "
                                    "extraction")
            return extras[name].float().mean(dim=1)
        if source not in extras:
            raise StrategyError(f"batch has no extras[{source!r}]: this strategy needs 'gradient' at extraction")
        return extras[source].float()

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        start = time.perf_counter()
        i = self._position[layer]
        h = hidden.float()  # [B, T, d]; the layer's token states are dropped when this returns
        batch, _, dim = h.shape
        if self._out is None:
            self._out = self._host((len(self.layers), len(self.specs), batch, dim))
        norms = torch.linalg.vector_norm(h, dim=-1) if self._norms_needed else None
        pooled = torch.empty((len(self.specs), batch, dim), dtype=torch.float32, device=h.device)
        weighted, rows = [], []
        sinks: dict[str, torch.Tensor] = {}  # the sink rule per mode, once per layer

        def sink(mode: str) -> torch.Tensor:
            if mode not in sinks:
                assert norms is not None
                sinks[mode] = self._sink_rows(norms, mode)
            return sinks[mode]

        filled_mode: list[str] = []

        def filled(mode: str) -> torch.Tensor:
            """The layer's states with every token left out (padding, a dropped sink) replaced by a kept token of
            its passage: max and min over all T are then the max and min over the kept tokens, for both
            reductions from one write (the host path reduces slices; a where per reduction costs twice this)."""
            if filled_mode != [mode]:
                keep = self._mask if mode == "keep" else self._mask & ~(sink(mode)[:, None] & self._first)
                if self._masked is None or self._masked.shape != h.shape:  # one [B, T, d] buffer per chunk
                    self._masked = torch.empty_like(h)
                kept = keep.to(torch.uint8).argmax(dim=1)  # the first kept token of each passage
                stand_in = h.gather(1, kept[:, None, None].expand(-1, 1, h.shape[-1]))
                torch.where(keep[:, :, None], h, stand_in, out=self._masked)
                filled_mode[:] = [mode]
            assert self._masked is not None
            return self._masked

        for s, (spec, source) in enumerate(zip(self.specs, self._sources, strict=True)):
            if source in ("max", "min"):
                masked = filled(spec.sink_mode)
                pooled[s] = masked.amax(dim=1) if source == "max" else masked.amin(dim=1)
                continue
            if isinstance(source, int):
                assert self._static is not None
                w = self._static[min(i, self._static.shape[0] - 1), source]
            else:
                w = torch.where(self._mask, self._layer_weights(source, norms, extras), 0.0)
                self._bad[s] |= ~torch.isfinite(w).all() | (w < 0).any()
            if spec.sink_mode != "keep":
                drop = sink(spec.sink_mode)
                if spec.sink_mode == "auto" and spec.attention_queries is not None:
                    drop = drop | self._attention_sink_rows(w, spec.attention_queries)
                w = w * ~(drop[:, None] & self._first)
            weighted.append(w)
            rows.append(s)
        if weighted:
            w = torch.stack(weighted)  # [Sw, B, T]
            totals = w.sum(dim=-1)
            empty = totals <= 0
            w = torch.where(empty[:, :, None], self._maskf, w)
            w = w / w.sum(dim=-1, keepdim=True)
            by_count = [self._by_count[s] for s in rows]
            if any(by_count):  # divide_by="token_count": the weighted sum over the real-token count
                count = torch.tensor(by_count, device=h.device)[:, None] & ~empty
                w = w * torch.where(count, totals / self._lengths.clamp(min=1), 1.0)[:, :, None]
            index = torch.tensor(rows, device=h.device)
            self._fallback[index] |= empty
            pooled[index] = torch.matmul(w.transpose(0, 1), h).transpose(0, 1)  # [B,Sw,T]@[B,T,d] -> [Sw,B,d]
        self._out[i].copy_(pooled, non_blocking=True)
        if self._supervised:
            self._pool_heads(i, h, extras)
        self.pool_seconds += time.perf_counter() - start

    def _pool_heads(self, i: int, h: torch.Tensor, extras: LayerExtras) -> None:
        """S3: every head's normalised inflow as token weights (iti.head_vectors), and its last-token output."""
        inflow = torch.where(self._mask[:, None, :], extras["attention_head_inflow"].float(), 0.0)  # [B, H, T]
        total = inflow.sum(dim=-1, keepdim=True)
        weights = torch.where(total > 0, inflow / torch.where(total > 0, total, 1.0), 0.0)
        per_head = torch.matmul(weights, h)  # [B, H, d]
        outputs = extras["attention_head_output_last"].float()
        if self._head_out is None:
            self._head_out = (self._host((len(self.layers), *per_head.shape)),
                              self._host((len(self.layers), *outputs.shape)))
        self._head_out[0][i].copy_(per_head, non_blocking=True)
        self._head_out[1][i].copy_(outputs, non_blocking=True)

    def finish(self) -> None:
        """Wait for the copies, check the device-side weights, and hold the chunk's pooled vectors."""
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        bad = self._bad.cpu().numpy()
        if bad.any():
            raise StrategyError(f"strategy {self.specs[int(bad.argmax())].id!r}: weights must be finite and "
                                "non-negative")
        assert self._out is not None
        self._masked = None
        self.pooled = PooledBatch(vectors=self._out.numpy(), strategy_ids=[spec.id for spec in self.specs],
                                  layers=self.layers, passage_ids=list(self.chunk.passage_ids),
                                  fallback=self._fallback.cpu().numpy())
        if self._head_out is not None:
            self.heads = (self._head_out[0].numpy(), self._head_out[1].numpy())
        self.transfer_seconds += time.perf_counter() - start


class HostPooler:
    """The reference way through the same seam: token states to the host (HostCapture), numpy pool_tokens.
    For weight rules that read token states themselves, and for runs that keep activations (dumps)."""

    def __init__(self, specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray]) -> None:
        self.specs = list(specs)
        self._capture = HostCapture(chunk, layers)
        self._host_extras = dict(host_extras)
        self.pool_seconds = 0.0
        self.transfer_seconds = 0.0
        self.activations: ActivationBatch | None = None
        self.pooled: PooledBatch | None = None
        self.heads: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        self._capture(layer, hidden, extras)

    def finish(self) -> None:
        start = time.perf_counter()
        self._capture.finish()
        batch = self._capture.activations
        assert batch is not None
        batch.extras.update(self._host_extras)
        self.activations = batch
        moved = time.perf_counter()
        self.pooled = pool_tokens(batch, self.specs)
        if any(selects_heads(spec) for spec in self.specs):
            self.heads = head_vectors(batch)
        self.transfer_seconds += moved - start
        self.pool_seconds += time.perf_counter() - moved


def chunk_pooler(specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray], device: torch.device | None) -> DevicePooler | HostPooler:
    """A DevicePooler on `device`, or the HostPooler where a weight rule reads token states (or device is None)."""
    return prepare_chunk_pooler(specs, chunk, layers, host_extras, device)()


def prepare_chunk_pooler(specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                         host_extras: Mapping[str, np.ndarray], device: torch.device | None
                         ) -> Callable[[], DevicePooler | HostPooler]:
    """chunk_pooler in two halves: this call does the CPU work (it may run on another thread, ahead of the
    forward), the function it returns makes the pooler and sends its weights (on the capture's thread)."""
    if device is not None:
        try:
            weights = host_weights(specs, chunk, layers, host_extras, pin=torch.device(device).type == "cuda")
        except HiddenOnDevice:
            pass
        else:
            return partial(DevicePooler, specs, chunk, layers, host_extras, device, weights)
    return partial(HostPooler, specs, chunk, layers, host_extras)
