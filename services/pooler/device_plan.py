"""The host half of device pooling: a chunk's strategies as a fixed plan of rows and indices, and every array
the device needs (static weights, the mask, uniform attention shares, index tensors) packed in one host buffer
that is sent once per chunk, so the per-layer work (device_pool.DevicePooler) never builds a tensor from Python.

Row layout per layer: the weights source rows are [static rows (one per static weight rule), layer rows (one per
distinct per-layer rule: token norms, attention inflow, gradients)]; every weights strategy picks one of them
(`perm`) and one sink rule (`rule`: keep, skip, auto by norm, auto by norm or by an attention row's inflow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.aggregation import norm_weights
from poolbench.pooler.pool import check_pool_inputs, checked_weights
from poolbench.pooler.reference import inverse_norm_weights
from poolbench.pooler.saliency import (
    attention_inflow_weights,
    attention_last_query_weights,
    gradient_norm_weights,
    gradient_x_input_weights,
)
from poolbench.pooler.sink import uniform_causal_inflow
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
# sink rules, rows of the per-layer [rules, B] drop table: the attention rules follow, one per attention row
KEEP, SKIP, AUTO = 0, 1, 2
_ALIGN = 8


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


@dataclass(frozen=True)
class PoolPlan:
    """What the layer loop does, fixed per chunk (Python ints only; the matching index tensors are in the blob)."""

    weighted: tuple[int, ...]  # spec positions pooled by weights, in row order
    reductions: tuple[int, ...]  # spec positions pooled by max/min
    kinds: tuple[str, ...]  # the distinct per-layer weight rules (LAYER_WEIGHTS values), in layer-row order
    kind_of: tuple[int, ...]  # per weighted row: its index in `kinds`, or -1 for a static row
    n_static: int
    static_layers: int  # 1 when every static rule is the same at every layer, else L
    attention_rows: tuple[int, ...]  # source rows whose inflow the attention sink rule reads (one rule each)
    any_sink: bool  # some strategy drops a sink token at some layer
    norms: bool  # token norms are needed (A4, A4_norm, the sink rule)
    by_count: bool  # some strategy divides by the token count


@dataclass(frozen=True)
class HostWeights:
    """What a DevicePooler sends to the device, built on the CPU from the chunk and its text extras alone (this part
    of a chunk's preparation may run ahead of the forward, on another thread): the plan and one host buffer holding
    every array, pinned for an async send on CUDA."""

    plan: PoolPlan
    blob: torch.Tensor  # uint8, every array of `layout` at an 8-byte aligned offset
    layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]  # name -> (offset, dtype, shape)


def host_weights(specs: Sequence[StrategySpec], chunk: PaddedBatch, layers: Sequence[int],
                 host_extras: Mapping[str, np.ndarray], *, pin: bool = False) -> HostWeights:
    """Every static weight rule run on the chunk (raises HiddenOnDevice when one reads token states), the rows and
    sink rules of every strategy, and the masks the per-layer rules need, in one buffer (`pin`: page-locked)."""
    mask = np.asarray(chunk.attention_mask, dtype=bool)
    check_pool_inputs(chunk.passage_ids, mask.sum(axis=1), specs)
    ctx = TokenContext.from_arrays(attention_mask=mask, special_mask=chunk.special_mask, offsets=chunk.offsets,
                                   input_ids=chunk.input_ids, texts=chunk.texts, passage_ids=chunk.passage_ids,
                                   extras=_HostExtras(host_extras))
    static: list[np.ndarray] = []
    kinds: list[str] = []
    weighted, reductions, source = [], [], []  # source: ("static", i) or ("layer", kind)
    for s, spec in enumerate(specs):
        if spec.kind == "reduction":
            reductions.append(s)
            continue
        weighted.append(s)
        if spec.weights_fn in LAYER_WEIGHTS:
            kind = LAYER_WEIGHTS[spec.weights_fn]
            if kind not in kinds:
                kinds.append(kind)
            source.append(("layer", kind))
        else:  # raises HiddenOnDevice when the rule reads token states: the caller pools on the host
            source.append(("static", len(static)))
            static.append(checked_weights(spec, ctx, len(layers)))
    n_static = len(static)
    perm = [i if where == "static" else n_static + kinds.index(i) for where, i in source]
    attention = [(row, specs[s].attention_queries) for s, row in zip(weighted, perm, strict=True)
                 if specs[s].sink_mode == "auto" and specs[s].attention_queries is not None]
    pairs = list(dict.fromkeys(attention))  # one attention sink rule per (row, queries)
    rule_w = [_rule(specs[s], row, pairs) for s, row in zip(weighted, perm, strict=True)]
    rule_r = [_rule(specs[s], -1, pairs) for s in reductions]
    arrays: dict[str, np.ndarray] = {
        "mask": mask.astype(np.uint8),
        "perm": np.asarray(perm, dtype=np.int64),
        "rule_w": np.asarray(rule_w, dtype=np.int64),
        "by_count": np.asarray([specs[s].divide_by == "token_count" for s in weighted], dtype=np.uint8),
        "w_index": np.asarray(weighted, dtype=np.int64),
        "r_index": np.asarray(reductions, dtype=np.int64),
        "rule_r": np.asarray(rule_r, dtype=np.int64),
        "r_base": np.asarray([0 if specs[s].reduction == "max" else 2 for s in reductions], dtype=np.int64),
        "uniform": np.stack([uniform_causal_inflow(mask, q) for _, q in pairs]) if pairs
        else np.zeros((0, *mask.shape)),
        "attention_rows": np.asarray([row for row, _ in pairs], dtype=np.int64),
    }
    static_layers = 1
    if static:
        static_layers = len(layers) if any(w.ndim == 3 for w in static) else 1
        arrays["static"] = np.stack([np.broadcast_to(w, (static_layers, *mask.shape)) for w in static], axis=1
                                    ).astype(np.float32)
    blob, layout = _pack(arrays, pin)
    plan = PoolPlan(weighted=tuple(weighted), reductions=tuple(reductions), kinds=tuple(kinds),
                    kind_of=tuple(-1 if where == "static" else kinds.index(i) for where, i in source),
                    n_static=n_static, static_layers=static_layers, attention_rows=tuple(r for r, _ in pairs),
                    any_sink=any(spec.sink_mode != "keep" for spec in specs),
                    norms=any(k in ("token_norms", "inverse_token_norms") for k in kinds)
                    or any(spec.sink_mode != "keep" for spec in specs),
                    by_count=any(specs[s].divide_by == "token_count" for s in weighted))
    return HostWeights(plan, blob, layout)


def _rule(spec: StrategySpec, row: int, pairs: list[tuple[int, str]]) -> int:
    if spec.sink_mode == "keep":
        return KEEP
    if spec.sink_mode == "skip":
        return SKIP
    if spec.attention_queries is not None and (row, spec.attention_queries) in pairs:
        return AUTO + 1 + pairs.index((row, spec.attention_queries))
    return AUTO


def _pack(arrays: Mapping[str, np.ndarray], pin: bool) -> tuple[torch.Tensor, dict]:
    """The arrays in one uint8 host tensor (one pin, one send); each at an offset its dtype can view."""
    layout, offset = {}, 0
    for name, array in arrays.items():
        layout[name] = (offset, torch.from_numpy(np.zeros(0, dtype=array.dtype)).dtype, array.shape)
        offset += -(-array.nbytes // _ALIGN) * _ALIGN
    blob = torch.empty(max(offset, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    raw = blob.numpy()
    for name, array in arrays.items():
        start = layout[name][0]
        raw[start:start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return blob, layout


def unpack(blob: torch.Tensor, layout: Mapping[str, tuple[int, torch.dtype, tuple[int, ...]]]
           ) -> dict[str, torch.Tensor]:
    """The arrays of `_pack` as views of `blob` (on whatever device it now is)."""
    out = {}
    for name, (offset, dtype, shape) in layout.items():
        size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        out[name] = blob[offset:offset + size].view(dtype).view(shape)
    return out
