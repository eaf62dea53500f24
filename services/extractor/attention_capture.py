"""Attention inflow at chosen layers, and the layer outputs' gradients of the passage's own log-likelihood.

Attention: during the capture the model's attention implementation is swapped for one that calls the original
(sdpa, eager, flash, ...) for the output and, only in the requested layers, recomputes that layer's attention
probabilities from the same query/key/mask, a chunk of queries at a time (attention_inflow), and reduces them
at once to per-head inflow [B, H, T] (mean over real queries, and the last real query's row) plus, on request,
each head's output at the last real token [B, H, Dh] (the head's attention-weighted sum of values, for S3). No
[B, H, T, T] map exists, only [B, H, chunk, T] of one layer at a time. Works for any transformers model
whose attention goes through ALL_ATTENTION_FUNCTIONS (Llama, Mistral, Gemma, Qwen, BERT, ...).

Gradient: the shallowest requested block's output is re-leafed with requires_grad, so the backward of S2's
log-likelihood (lm_head_likelihood) stops there and reaches every requested layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from poolbench.errors import PoolBenchError

from .attention_inflow import ScoreRule, attention_inflow, last_real_index, later_keys_allowed
from .hook_points import _hidden_of, _with_hidden

CAPTURE_PREFIX = "poolbench_capture_"


class AttentionCaptureError(PoolBenchError):
    """A model whose attention cannot be observed this way."""


@dataclass
class _Route:
    layer: int
    query_mask: torch.Tensor  # [B, T] bool
    last_index: torch.Tensor  # [B] long
    head_outputs: bool
    out: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    # id(mask) -> (layer that first met it, the mask, whether it lets a real query see a later key), shared by a
    # capture's routes: a forward hands every layer the same mask object, so it is checked once (the mask is held
    # so its id is not reused within the forward)
    later_keys: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_ROUTES: dict[int, _Route] = {}  # id(module inside a requested block) -> route
_ORIGINAL: dict[int, str] = {}  # id(config) -> attention implementation it had before the capture


def _original_function(module: nn.Module, name: str | None) -> Callable:
    if name in (None, "eager"):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise AttentionCaptureError(f"{type(module).__name__}: no eager_attention_forward to delegate to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[name]


def _capturing_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs):
    name = _ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    output, weights = _original_function(module, name)(module, query, key, value, attention_mask, **kwargs)
    route = _ROUTES.get(id(module))
    if route is not None:
        with torch.no_grad():
            _record(route, module, query, key, attention_mask, output, kwargs)
    return output, weights


def _record(route: _Route, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
            attention_mask: torch.Tensor | None, output: torch.Tensor, kwargs: dict) -> None:
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = None  # a padding-only mask (flash attention): padding keys are masked by the query mask
    rule = ScoreRule(scaling=kwargs.get("scaling") or query.shape[-1] ** -0.5, softcap=kwargs.get("softcap"),
                     causal=bool(getattr(module, "is_causal", False)), mask=attention_mask)
    last = route.last_index.to(query.device)
    if rule.causal and attention_mask is not None and id(attention_mask) not in route.later_keys:
        route.later_keys[id(attention_mask)] = (
            route.layer, attention_mask,
            later_keys_allowed(attention_mask, route.query_mask, query.shape[2], key.shape[2]))
    inflow = attention_inflow(query, key, route.query_mask, last, rule)
    record = {"inflow": inflow.mean, "inflow_last": inflow.last}  # [B, H, Tk] each
    if route.head_outputs:
        rows = torch.arange(output.shape[0], device=output.device)
        record["head_output_last"] = output[rows, last].float()  # output is [B, T, H, Dh]
    route.out[route.layer] = record


def _register(name: str) -> str:
    captured = f"{CAPTURE_PREFIX}{name}"
    if captured not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(captured, _capturing_attention)
    if captured not in ALL_MASK_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(captured, ALL_MASK_ATTENTION_FUNCTIONS[name])
    return captured


def _configs(model: nn.Module, decoder_layers: Sequence[nn.Module]) -> list:
    found = {}
    candidates = [getattr(model, "config", None)]
    if candidates[0] is not None and hasattr(candidates[0], "get_text_config"):
        candidates.append(candidates[0].get_text_config())
    candidates += [getattr(m, "config", None) for block in decoder_layers for m in block.modules()]
    for config in candidates:
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            found[id(config)] = config
    return list(found.values())


@contextmanager
def capture_attention(model: nn.Module, decoder_layers: Sequence[nn.Module], layers: Sequence[int],
                      attention_mask: torch.Tensor, *, head_outputs: bool = False,
                      checks: list[Callable[[], None]] | None = None
                      ) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Yield {layer: {"inflow", "inflow_last": [B,H,T], "head_output_last": [B,H,Dh]}} filled by a forward.

    Whether the forward's mask let a real query see a later key is a device value: read at the exit, it made the
    host wait for everything enqueued, the chunk's backward and pooling included. With `checks` it is copied to the
    host behind that work and the check (LaterKeyCheck) appended there, for the caller to run once it waits for
    the chunk anyway (capture._finish_chunk); without, it runs at the exit."""
    mask = attention_mask.to(torch.bool)
    last = last_real_index(mask)
    out: dict[int, dict[str, torch.Tensor]] = {}
    configs = _configs(model, decoder_layers)
    routed: list[int] = []
    later_keys: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
    for layer in layers:
        route = _Route(layer, mask, last, head_outputs, out, later_keys)
        for module in decoder_layers[layer].modules():
            _ROUTES[id(module)] = route
            routed.append(id(module))
    saved = [(config, config._attn_implementation_internal) for config in configs]
    try:
        for config, name in saved:
            current = name if isinstance(name, str) else "sdpa"
            if current.startswith(CAPTURE_PREFIX):
                raise AttentionCaptureError("attention capture is already active on this model")
            _ORIGINAL[id(config)] = current
            config._attn_implementation_internal = _register(current)
        yield out
    finally:
        for config, name in saved:
            config._attn_implementation_internal = name
            _ORIGINAL.pop(id(config), None)
        for key in routed:
            _ROUTES.pop(key, None)
    missing = [layer for layer in layers if layer not in out]
    if missing:
        raise AttentionCaptureError(f"layers {missing}: attention never went through transformers' attention "
                                    f"interface in {type(model).__name__}; S1/S3 cannot observe it")
    if later_keys:  # a mask or two (one per device)
        check = LaterKeyCheck(type(model).__name__, [(layer, flag) for layer, _, flag in later_keys.values()])
        if checks is None:
            check()
        else:
            checks.append(check)


class LaterKeyCheck:
    """The later-key flags of one forward's masks, copied to pinned host memory without waiting (on a GPU); calling
    it waits for those copies alone and stops naming the first layer whose mask let a real query see a later key."""

    def __init__(self, model_name: str, flags: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.model_name = model_name
        self.layers = [layer for layer, _ in flags]
        cuda = [flag for _, flag in flags if flag.device.type == "cuda"]
        self.host = torch.empty(len(flags), dtype=torch.bool, pin_memory=bool(cuda))
        self.events: list[torch.cuda.Event] = []
        for i, (_, flag) in enumerate(flags):
            self.host[i].copy_(flag.reshape(()), non_blocking=flag.device.type == "cuda")
        for device in {flag.device for flag in cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)

    def __call__(self) -> None:
        for event in self.events:
            event.synchronize()
        bad = [layer for layer, flag in zip(self.layers, self.host, strict=True) if bool(flag)]
        if bad:
            raise AttentionCaptureError(f"layer {bad[0]}: {self.model_name}'s causal attention was given a mask that "
                                        "lets a query see a later key; S1/S3's inflow assumes a causal mask")


@contextmanager
def gradient_layer_outputs(decoder_layers: Sequence[nn.Module], layers: Sequence[int]
                           ) -> Iterator[dict[int, torch.Tensor]]:
    """Yield {layer: hidden [B,T,d]} still attached to the graph; the shallowest is a fresh grad leaf."""
    first = min(layers)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(_module: nn.Module, _args: object, output: object) -> object:
            hidden = _hidden_of(output)
            if layer == first:
                hidden = hidden.detach().requires_grad_(True)
                captured[layer] = hidden
                return _with_hidden(output, hidden)
            captured[layer] = hidden
            return None

        return hook

    handles = [decoder_layers[layer].register_forward_hook(make_hook(layer)) for layer in layers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()

