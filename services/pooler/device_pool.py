"""Pooling inside the capture: each layer's token states are pooled by torch on the model's device as the layer
runs, and only pooled vectors [S, B, d] leave it (on a GPU staged on the device and sent in one copy a chunk on a
copy stream, into reused page-locked buffers: device_staging).

A chunk's strategies become a fixed plan before the forward (device_plan: static weights, masks and index tensors
in one buffer, sent once). Per layer the work is a fixed number of device ops whatever the number of strategies:
the per-layer weight rows (token norms, attention inflow, gradients) stacked beside the static rows, every
strategy's row picked by one index_select, the sink rule for every strategy as one masked fill, normalisation as
one division, one batched product [B, S, T] @ [B, T, d] (S3's per-head weights in the same product) and max/min
from one filled buffer in the states' dtype. Nothing inside the layer loop reads a device value on the host or
builds a tensor from Python. The same code runs on CPU and GPU; `pool_tokens` (numpy hand-off, pool.py) is its
reference twin. A weight rule that reads token states itself sends its chunk the reference way (HostPooler).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import torch

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.layer_sinks import HostCapture, LayerExtras
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.device_plan import AUTO, KEEP, SKIP, HostWeights, host_weights, unpack
from poolbench.pooler.device_staging import DeviceStaging, flat_views, layout_numel
from poolbench.pooler.iti import head_vectors, selects_heads
from poolbench.pooler.pool import PooledBatch, pool_tokens
from poolbench.pooler.reference import NORM_EPS
from poolbench.pooler.sink import AUTO_OTHERS, SINK_RATIO
from poolbench.pooler.spec import HiddenOnDevice, StrategySpec

STAGED_ENV = "POOLBENCH_STAGED_COPIES"  # "0": a device pooler copies each layer out on the compute stream (A/B)


def staged_by_default(device: torch.device) -> bool:
    """Whether a pooler on `device` stages its output (device_staging): on any device but the CPU, unless
    $POOLBENCH_STAGED_COPIES is "0", which keeps the copy a layer on the compute stream for an A/B on a GPU. A
    tuning knob, never a result: the same kernels write the same values either way."""
    return device.type != "cpu" and os.environ.get(STAGED_ENV, "1") != "0"


_ATTENTION = {"attention_inflow": "attention_head_inflow", "attention_inflow_last": "attention_head_inflow_last"}


class HostBuffers:
    """Page-locked host memory for a run's pooled vectors, reused chunk after chunk (allocating pinned memory costs
    more than the copy into it): a pooler takes one, the table builder gives it back once it has copied the rows
    out; a buffer too small for a chunk is replaced by one that fits."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.allocated = 0  # how many buffers were ever allocated (a bench and a test read it)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= numel]
            if fits:
                buffer = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not buffer]
                return buffer
            if self._free:  # too small for this chunk: let the largest go, so memory stays bounded
                # by position, not list.remove: that compares tensors with ==, elementwise, and raised whenever the
                # largest was not first (the order buffers come back in from the table thread)
                del self._free[max(range(len(self._free)), key=lambda i: self._free[i].numel())]
            self.allocated += 1
        with torch.inference_mode(False):  # a normal tensor: chunks captured with and without grad share it
            return torch.empty(numel, dtype=torch.float32, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)


def _numpy_median(values: torch.Tensor, left_out: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                  none: torch.Tensor) -> torch.Tensor:
    """[..., B] median over the entries of each row not `left_out`, as np.nanmedian gives it (mean of the two middle
    values for an even count; NaN where nothing is kept; torch.nanmedian takes the lower one instead). `low`, `high`
    [..., B, 1] are the middle positions and `none` [B] where a row keeps nothing: fixed per chunk."""
    ordered = values.masked_fill(left_out, float("inf")).sort(dim=-1).values
    middle = (ordered.gather(-1, low) + ordered.gather(-1, high)).squeeze(-1) / 2
    return middle.masked_fill(none, float("nan"))


def bfloat16_parts(weights: torch.Tensor) -> torch.Tensor:
    """[..., R, T] float32 -> [..., 3R, T] bfloat16 (high, middle, low parts) whose float32 sum is the weights
    exactly: each part takes the next 8 significant bits of what the ones before left (bfloat16's exponent range is
    float32's, so no part underflows before float32 itself would)."""
    high = weights.to(torch.bfloat16)
    rest = weights - high.float()
    middle = rest.to(torch.bfloat16)
    return torch.cat([high, middle, (rest - middle.float()).to(torch.bfloat16)], dim=-2)


_OUT_DTYPE_BMM = hasattr(torch.ops.aten.bmm, "dtype")  # torch.bmm(..., out_dtype=): bfloat16 in, float32 out


def weighted_sums(weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[B, R, T] float32 weights @ [B, T, d] states -> [B, R, d] float32 with float32 rounding of every product and
    sum. bfloat16 states on CUDA: the weights in three exact bfloat16 parts (bfloat16_parts), each product of two
    bfloat16 numbers is exact in float32 and the GEMM accumulates in float32, so the states are read once in their
    dtype and never copied to float32. Other dtypes are cast (CPU's bfloat16 GEMMs round their output to bfloat16;
    float16's exponent range cannot hold the split's low parts)."""
    if hidden.dtype == torch.float32:
        return torch.bmm(weights, hidden)
    if hidden.dtype == torch.bfloat16 and hidden.is_cuda and _OUT_DTYPE_BMM:
        parts = torch.bmm(bfloat16_parts(weights), hidden, out_dtype=torch.float32)
        return parts.unflatten(1, (3, weights.shape[1])).sum(dim=1)
    return torch.bmm(weights, hidden.float())


class DevicePooler:
    """A capture sink for one chunk: pools every strategy at each layer on the layer's device, keeps nothing of
    the token states, and after `finish` holds `pooled` (a PooledBatch) and, for supervised strategies, `heads`
    (per-head pooled vectors [L, B, H, d] and last-token head outputs [L, B, H, Dh]). `weights` are the chunk's
    HostWeights when they were built ahead (else built here); `buffers` lends a run's reused host buffers (then
    `pooled` is a view of one until `release`), else the pooler allocates its own. `staged` (by default on any
    device but the CPU) writes each layer into a device buffer sent to the host in one copy on a copy stream once the
    chunk is launched (device_staging), where a copy a layer on the compute stream held the next layer's kernels."""

    def __init__(self, specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray], device: torch.device,
                 weights: HostWeights | None = None, buffers: HostBuffers | None = None,
                 staged: bool | None = None) -> None:
        self.specs = list(specs)
        self.chunk = chunk
        self.layers = tuple(int(layer) for layer in layers)
        self.device = torch.device(device)
        self.pool_seconds = 0.0
        self.transfer_seconds = 0.0
        self.activations: ActivationBatch | None = None
        self.pooled: PooledBatch | None = None
        self.heads: tuple[np.ndarray, np.ndarray] | None = None
        cuda = self.device.type == "cuda"
        self._buffers = buffers if buffers is not None else HostBuffers(pin=cuda)
        if weights is None:
            weights = host_weights(self.specs, chunk, self.layers, host_extras, pin=cuda)
        plan = self._plan = weights.plan
        self._supervised = any(selects_heads(spec) for spec in self.specs)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        a = self._arrays = unpack(weights.blob.to(self.device, non_blocking=True), weights.layout)
        mask = self._mask = a["mask"].view(torch.bool)
        batch, length = mask.shape
        self._maskf = mask.float()
        lengths = mask.sum(dim=1)
        self._lengthsf = lengths.float()
        first_index = a["mask"].argmax(dim=1)
        self._first_index = first_index[:, None]
        self._first = torch.arange(length, device=self.device)[None, :] == self._first_index
        others = self._others = mask & ~self._first
        stand = torch.where(lengths >= 2, others.to(torch.uint8).argmax(dim=1), first_index)  # a kept token
        self._stand_index = stand[:, None, None]
        n = others.sum(dim=1)  # the sink rule's baseline: the passage's other real tokens
        self._low, self._high = ((n - 1).clamp(min=0) // 2)[:, None], (n // 2).clamp(max=length - 1)[:, None]
        self._none = n == 0
        self._pad, self._not_others = ~mask, ~others
        self._long = lengths > AUTO_OTHERS
        self._fixed_rules = torch.stack([torch.zeros_like(mask[:, 0]), lengths >= 2])  # KEEP, SKIP
        n_attention = len(plan.attention_rows)
        self._uniform = torch.where(mask, a["uniform"], 1.0)  # [A, B, T]: where masked out, any nonzero
        self._attention_low = self._low.expand(n_attention, -1, -1)
        self._attention_high = self._high.expand(n_attention, -1, -1)
        self._attention_first = self._first_index.expand(n_attention, -1, -1)
        self._by_count = a["by_count"].bool()[:, None]
        self._fallback = torch.zeros((len(plan.weighted), batch), dtype=torch.bool, device=self.device)
        self._bad = torch.zeros(len(plan.kinds), dtype=torch.bool, device=self.device)
        self._host: torch.Tensor | None = None
        self._views: dict[str, torch.Tensor] = {}  # of the host buffer, which finish reads
        self._staged = staged_by_default(self.device) if staged is None else staged
        self._staging: DeviceStaging | None = None
        self._write: dict[str, torch.Tensor] = {}  # where the layers write: the staging's views, else the host's
        self._out: torch.Tensor | None = None  # unstaged on a device: [S, B, d] scratch, copied out at every layer
        self._filled: torch.Tensor | None = None
        self._launched = False
        self._event: torch.cuda.Event | None = None
        self.release: Callable[[], None] = lambda: None
        assert (KEEP, SKIP, AUTO) == (0, 1, 2)  # the rows of _fixed_rules, then the norm rule, then attention

    def _allocate(self, hidden: torch.Tensor, extras: LayerExtras) -> None:
        """The chunk's host buffer (one, from the run's reused ones) and views of it; the device staging of the
        same layout and the device scratch."""
        batch, _, dim = hidden.shape
        n_layers, n_specs = len(self.layers), len(self.specs)
        shapes = {"out": (n_layers, n_specs, batch, dim),
                  "flags": (len(self._plan.weighted) * batch + len(self._plan.kinds),)}
        if self._supervised:
            inflow, outputs = extras["attention_head_inflow"], extras["attention_head_output_last"]
            shapes["heads"] = (n_layers, batch, inflow.shape[1], dim)
            shapes["outputs"] = (n_layers, *outputs.shape)
        self._host = self._buffers.take(layout_numel(shapes))
        self.release = weakref.finalize(self, self._buffers.give, self._host)
        self._views = flat_views(self._host, shapes)
        if self._staged:
            self._staging = DeviceStaging(shapes, hidden.device)
        self._write = self._staging.views if self._staging is not None else self._views
        if not self._staged and self.device.type != "cpu":
            self._out = torch.empty((n_specs, batch, dim), dtype=torch.float32, device=self.device)
        if self._plan.reductions:
            self._filled = torch.empty_like(hidden)

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        start = time.perf_counter()
        i = self._position[layer]
        plan, a = self._plan, self._arrays
        if hidden.dtype != torch.float32 and not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and _OUT_DTYPE_BMM):
            hidden = hidden.float()  # the product needs float32 there, and CPU's bfloat16 kernels lose to one cast
        if self._host is None:
            self._allocate(hidden, extras)
        out = self._out if self._out is not None else self._write["out"][i]
        norms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32) if plan.norms else None
        rows = self._source_rows(i, norms, extras) if plan.weighted else None
        drop = self._drop_rules(norms, rows) if plan.any_sink else None
        products = []
        if rows is not None:
            weights = rows.index_select(0, a["perm"])  # [Sw, B, T]
            if drop is not None:
                weights = weights.masked_fill(drop.index_select(0, a["rule_w"])[:, :, None] & self._first, 0.0)
            totals = weights.sum(dim=-1)
            empty = totals <= 0  # nothing selected: the plain mean (A1), flagged as a fallback
            self._fallback |= empty
            divide = torch.where((self._by_count | empty) if plan.by_count else empty, self._lengthsf, totals)
            weights = torch.where(empty[:, :, None], self._maskf, weights) / divide[:, :, None]
            products.append(weights.transpose(0, 1))
        if self._supervised:
            products.append(self._head_weights(extras))
        if products:
            pooled = weighted_sums(torch.cat(products, dim=1) if len(products) > 1 else products[0], hidden)
            if rows is not None:
                out.index_copy_(0, a["w_index"], pooled[:, :len(plan.weighted)].transpose(0, 1))
            if self._supervised:
                self._write["heads"][i].copy_(pooled[:, len(plan.weighted):], non_blocking=True)
                self._write["outputs"][i].copy_(extras["attention_head_output_last"], non_blocking=True)
        if plan.reductions:
            out.index_copy_(0, a["r_index"], self._reduce(hidden, drop))
        if self._out is not None:
            self._views["out"][i].copy_(out, non_blocking=True)
        self.pool_seconds += time.perf_counter() - start

    def _source_rows(self, i: int, norms: torch.Tensor | None, extras: LayerExtras) -> torch.Tensor:
        """[static rows + layer rows, B, T] float32: the chunk's static weights at this layer, then each per-layer
        rule's weights (zero on padding); a negative or non-finite layer weight is flagged for `finish`."""
        plan = self._plan
        layer_rows = [self._layer_weights(kind, norms, extras) for kind in plan.kinds]
        static = self._arrays["static"][min(i, plan.static_layers - 1)] if plan.n_static else None
        if not layer_rows:
            assert static is not None
            return static
        values = torch.stack(layer_rows).masked_fill(self._pad, 0.0)
        low, high = torch.aminmax(values.flatten(1), dim=1)
        self._bad |= ~(low >= 0) | (high == float("inf"))
        return torch.cat([static, values]) if static is not None else values

    def _layer_weights(self, kind: str, norms: torch.Tensor | None, extras: LayerExtras) -> torch.Tensor:
        if kind == "token_norms":
            assert norms is not None
            return norms
        if kind == "inverse_token_norms":
            assert norms is not None
            return 1.0 / (norms + NORM_EPS)
        if kind in _ATTENTION:
            if _ATTENTION[kind] not in extras:
                raise StrategyError(f"batch has no extras[{kind!r}]: this strategy needs 'attention' at extraction")
            return extras[_ATTENTION[kind]].float().mean(dim=1)
        if kind not in extras:
            raise StrategyError(f"batch has no extras[{kind!r}]: this strategy needs 'gradient' at extraction")
        return extras[kind].float()

    def _drop_rules(self, norms: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor:
        """[rules, B] whether each rule (KEEP, SKIP, AUTO by norm, AUTO by norm or an attention row's inflow,
        sink.sink_rows and sink.attention_sink_rows) leaves the first real token out at this layer."""
        assert norms is not None
        ratio = norms.gather(1, self._first_index).squeeze(1) / _numpy_median(
            norms, self._not_others, self._low, self._high, self._none)
        auto = self._long & (ratio >= SINK_RATIO)
        rules = torch.cat([self._fixed_rules, auto[None]])
        if not self._plan.attention_rows:
            return rules
        assert rows is not None  # in float64 as sink.attention_sink_rows
        relative = (rows.index_select(0, self._arrays["attention_rows"]).double() / self._uniform).masked_fill(
            self._pad, float("nan"))
        ratio = relative.gather(2, self._attention_first).squeeze(2) / _numpy_median(
            relative, self._not_others, self._attention_low, self._attention_high, self._none)
        return torch.cat([rules, auto | (self._long & (ratio >= SINK_RATIO))])

    def _head_weights(self, extras: LayerExtras) -> torch.Tensor:
        """S3: every head's normalised inflow [B, H, T] as token weights (iti.head_vectors)."""
        inflow = extras["attention_head_inflow"].float().masked_fill(self._pad[:, None, :], 0.0)
        total = inflow.sum(dim=-1, keepdim=True)
        nothing = ~(total > 0)  # NaN too, as iti.head_vectors
        return (inflow / total.masked_fill(nothing, 1.0)).masked_fill(nothing, 0.0)

    def _reduce(self, hidden: torch.Tensor, drop: torch.Tensor | None) -> torch.Tensor:
        """[Sr, B, d] max/min in the states' dtype, as float32: one buffer holds the states with every token but
        the passage's first real one kept, the rest standing in for a kept token; max/min over it, then with the
        first token, give both answers for every passage, and each strategy's sink rule picks one."""
        a, filled = self._arrays, self._filled
        assert filled is not None
        dim = hidden.shape[-1]
        torch.where(self._others[:, :, None], hidden, hidden.gather(1, self._stand_index.expand(-1, 1, dim)),
                    out=filled)
        rest_max, rest_min = filled.amax(dim=1), filled.amin(dim=1)  # aminmax over T is 5x slower on CPU
        first = hidden.gather(1, self._first_index[:, :, None].expand(-1, 1, dim)).squeeze(1)
        choices = torch.stack([torch.maximum(rest_max, first), rest_max, torch.minimum(rest_min, first), rest_min])
        pick = a["r_base"][:, None] + (drop.index_select(0, a["rule_r"]) if drop is not None
                                       else self._fixed_rules[KEEP])
        return choices.gather(0, pick[:, :, None].expand(-1, -1, dim)).float()

    def launched(self) -> bool:
        """Every layer is enqueued: the flags are written behind them, the staged output goes to the host in one copy
        on the copy stream, and its event marks the chunk's end, so `finish` may come after a later chunk is
        enqueued and still wait for this chunk alone (unstaged on CUDA, an event on the compute stream behind the
        flags' copy). The device scratch is let go here (the allocator reuses it in stream order) so a chunk
        finished late holds none."""
        assert self._host is not None
        self._write["flags"].copy_(torch.cat([self._fallback.flatten(), self._bad]).float(), non_blocking=True)
        if self._staging is not None:
            self._event = self._staging.send(self._host)
            self._staging = None
        elif self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._write = {}
        self._filled = self._out = None
        self._launched = True
        return True

    def hand_over(self) -> None:
        """The host buffer is the tables' from now (a job's last chunk, whose rows keep views of it): it never goes
        back to the run's buffers, so no later chunk can write over rows a table holds."""
        if isinstance(self.release, weakref.finalize):
            self.release.detach()
        self.release = lambda: None

    def finish(self) -> None:
        """Wait for this chunk's copies (its event, not the whole device), check the device-side weights, and
        hold the chunk's pooled vectors (views of the host buffer)."""
        start = time.perf_counter()
        if not self._launched:
            self.launched()
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        flags = self._views["flags"]
        plan, batch = self._plan, len(self.chunk.passage_ids)
        values = flags.numpy() != 0
        bad = values[len(plan.weighted) * batch:]
        if bad.any():
            spec = self.specs[next(s for s, k in zip(plan.weighted, plan.kind_of, strict=True) if k >= 0 and bad[k])]
            raise StrategyError(f"strategy {spec.id!r}: weights must be finite and non-negative")
        fallback = np.zeros((len(self.specs), batch), dtype=bool)
        fallback[list(plan.weighted)] = values[:len(plan.weighted) * batch].reshape(-1, batch)
        self.pooled = PooledBatch(vectors=self._views["out"].numpy(), strategy_ids=[spec.id for spec in self.specs],
                                  layers=self.layers, passage_ids=list(self.chunk.passage_ids), fallback=fallback)
        if self._supervised:
            self.heads = (self._views["heads"].numpy(), self._views["outputs"].numpy())
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

    def release(self) -> None:
        """Nothing to give back: this chunk's arrays are its own."""

    def hand_over(self) -> None:
        """Nothing to hand over: this chunk's arrays are its own."""

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
                 host_extras: Mapping[str, np.ndarray], device: torch.device | None,
                 buffers: HostBuffers | None = None) -> DevicePooler | HostPooler:
    """A DevicePooler on `device`, or the HostPooler where a weight rule reads token states (or device is None)."""
    return prepare_chunk_pooler(specs, chunk, layers, host_extras, device, buffers)()


def prepare_chunk_pooler(specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                         host_extras: Mapping[str, np.ndarray], device: torch.device | None,
                         buffers: HostBuffers | None = None) -> Callable[[], DevicePooler | HostPooler]:
    """chunk_pooler in two halves: this call does the CPU work (it may run on another thread, ahead of the
    forward), the function it returns makes the pooler and sends its weights (on the capture's thread)."""
    if device is not None:
        try:
            weights = host_weights(specs, chunk, layers, host_extras, pin=torch.device(device).type == "cuda")
        except HiddenOnDevice:
            pass
        else:
            return partial(DevicePooler, specs, chunk, layers, host_extras, device, weights, buffers)
    return partial(HostPooler, specs, chunk, layers, host_extras)
