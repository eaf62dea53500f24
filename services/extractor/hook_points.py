"""Named hook points on a model's decoder blocks, added and always removed through context managers.

In the spirit of TransformerLens's hook_points.py: "layers.{L}.out" is the residual stream right after
block L (before any final norm), whatever the architecture. Blocks may return the hidden state itself or a
tuple whose first element is it (older transformers releases, some remote-code models); both are handled.
HF's `output_hidden_states` tuple has layers.L.out at index L+1, except its last entry, which transformers 5
replaces with the final-normed `last_hidden_state` for models with a final norm (Llama, not BERT).

Hooks are request-local: each one acts only on forwards run in the context (thread, or contextvars copy of it)
that opened its `with` block, so two threads sharing one model (HTTP requests on a Serve replica) never run
each other's captures, early stops or steering deltas.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from poolbench.errors import PoolBenchError

from .activations import hook_point_name

HookFn = Callable[[torch.Tensor], "torch.Tensor | None"]
_HOOK_POINT = re.compile(r"^layers\.(\d+)\.out$")
_OPEN_SCOPES: ContextVar[frozenset[object]] = ContextVar("poolbench_hook_scopes", default=frozenset())


class HookPointError(PoolBenchError):
    """A hook point name or layer index that the model does not have."""


class _StopForward(Exception):
    """Raised in the deepest requested block so the rest never runs; `owner` ties it to one capture."""

    def __init__(self, owner: object) -> None:
        super().__init__("forward stopped after the deepest captured layer")
        self.owner = owner


def _hidden_of(output: object) -> torch.Tensor:
    """The hidden state a block returned: the tensor itself, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"decoder block returned {type(output).__name__}; expected a tensor or tuple led by one")


def _with_hidden(output: object, hidden: torch.Tensor) -> object:
    """`output` with its hidden state replaced, keeping its shape (tensor or tuple)."""
    if isinstance(output, torch.Tensor):
        return hidden
    return (hidden, *output[1:])  # type: ignore[index]


def _check_layers(decoder_layers: Sequence[nn.Module], layers: Sequence[int]) -> tuple[int, ...]:
    n = len(decoder_layers)
    layers = tuple(int(layer) for layer in layers)
    if not layers:
        raise HookPointError("no layers requested; give at least one layer index")
    bad = [layer for layer in layers if not 0 <= layer < n]
    if bad:
        raise HookPointError(f"layers {bad} out of range: the model has {n} decoder layers (0..{n - 1})")
    if len(set(layers)) != len(layers):
        raise HookPointError(f"layers {list(layers)} repeat an index")
    return layers


@contextmanager
def _hook_scope() -> Iterator[object]:
    """A token that is open only in this context for the `with` block: hooks bound to it ignore other threads."""
    token = object()
    reset = _OPEN_SCOPES.set(_OPEN_SCOPES.get() | {token})
    try:
        yield token
    finally:
        _OPEN_SCOPES.reset(reset)


def _in_scope(token: object) -> bool:
    return token in _OPEN_SCOPES.get()


def parse_hook_point(name: str, n_layers: int) -> int:
    """The layer index of a hook point name such as "layers.3.out"."""
    match = _HOOK_POINT.match(name)
    if match is None:
        raise HookPointError(f"unknown hook point {name!r}; expected 'layers.<L>.out'")
    layer = int(match.group(1))
    if layer >= n_layers:
        raise HookPointError(f"hook point {name!r} out of range: the model has {n_layers} decoder layers")
    return layer


@contextmanager
def capture_layer_outputs(
    decoder_layers: Sequence[nn.Module], layers: Sequence[int], *, stop_early: bool = True,
    sink: Callable[[int, torch.Tensor], None] | None = None,
) -> Iterator[dict[int, torch.Tensor]]:
    """Yield a dict that fills with {L: hidden [B,T,d]} at "layers.{L}.out" during a forward inside the block.

    With `stop_early`, the deepest requested block raises a private signal that this context swallows, so
    later blocks, the final norm and any LM head never run: the forward call does not return, and code after
    it inside the `with` block is skipped. A `sink` receives each hidden state instead of the dict, so a
    caller copying into one buffer does not keep every layer's output alive. Hooks are removed on exit, also
    when the forward raises; forwards other threads run meanwhile are neither captured nor stopped.
    """
    layers = _check_layers(decoder_layers, layers)
    deepest = max(layers)
    captured: dict[int, torch.Tensor] = {}

    with _hook_scope() as token:

        def make_hook(layer: int) -> Callable[[nn.Module, object, object], None]:
            def hook(_module: nn.Module, _args: object, output: object) -> None:
                if not _in_scope(token):
                    return
                if sink is None:
                    captured[layer] = _hidden_of(output).detach()
                else:
                    sink(layer, _hidden_of(output).detach())
                if stop_early and layer == deepest:
                    raise _StopForward(token)

            return hook

        handles = [decoder_layers[layer].register_forward_hook(make_hook(layer)) for layer in layers]
        try:
            yield captured
        except _StopForward as stop:
            if stop.owner is not token:
                raise
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def add_hooks(decoder_layers: Sequence[nn.Module], hooks: Mapping[str, HookFn]) -> Iterator[None]:
    """Run `fn(hidden) -> new hidden` (None keeps it) at each named hook point, as TransformerLens hooks().

    Hooks are prepended so anything else watching the block (HF's output recorder, a capture) sees the edited
    hidden state; all are removed on exit, also on error. Forwards other threads run meanwhile are left as they are.
    """
    n_layers = len(decoder_layers)
    targets = [(parse_hook_point(name, n_layers), fn) for name, fn in hooks.items()]

    with _hook_scope() as token, ExitStack() as stack:

        def make_hook(fn: HookFn) -> Callable[[nn.Module, object, object], object]:
            def hook(_module: nn.Module, _args: object, output: object) -> object:
                if not _in_scope(token):
                    return None
                new = fn(_hidden_of(output))
                return None if new is None else _with_hidden(output, new)

            return hook

        for layer, fn in targets:
            handle = decoder_layers[layer].register_forward_hook(make_hook(fn), prepend=True)
            stack.callback(handle.remove)
        yield


__all__ = ["HookPointError", "add_hooks", "capture_layer_outputs", "hook_point_name", "parse_hook_point"]
