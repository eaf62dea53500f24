"""Activation sites inside a decoder block: "layers.{L}.residual" (the block's output, the same tensor as
"layers.{L}.out"), "layers.{L}.attn" (the attention sub-block's output, before it is added to the residual
stream) and "layers.{L}.mlp" (the MLP sub-block's output, likewise). For a pre-norm block (Llama, Gemma without
post-norms, GGUF-converted models, which load as HF models) residual_out = residual_in + attn + mlp.

The sub-blocks are found by the attribute names transformers gives them (self_attn / attn / attention, mlp /
feed_forward); a block without one is a one-line HookPointError naming the layer and the site.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from .hook_points import HookPointError, _check_layers, _hidden_of

SITES = ("residual", "attn", "mlp")
_SITE_HOOK = re.compile(r"^layers\.(\d+)\.(residual|attn|mlp|out)$")
_ATTRIBUTES = {"attn": ("self_attn", "attn", "attention"), "mlp": ("mlp", "feed_forward")}


def site_hook_point_name(layer: int, site: str) -> str:
    return f"layers.{int(layer)}.{site}"


def parse_site_hook_point(name: str, n_layers: int) -> tuple[int, str]:
    """(layer, site) of "layers.3.attn"; "layers.3.out" is the residual site."""
    match = _SITE_HOOK.match(name)
    if match is None:
        raise HookPointError(f"unknown hook point {name!r}; expected 'layers.<L>.<site>' with site one of "
                             f"{', '.join(SITES)}")
    layer, site = int(match.group(1)), match.group(2)
    if layer >= n_layers:
        raise HookPointError(f"hook point {name!r} out of range: the model has {n_layers} decoder layers")
    return layer, "residual" if site == "out" else site


def check_sites(sites: Sequence[str]) -> tuple[str, ...]:
    bad = [site for site in sites if site not in SITES]
    if bad or not sites:
        raise HookPointError(f"sites {bad or list(sites)}: each must be one of {', '.join(SITES)}")
    return tuple(dict.fromkeys(sites))


def site_module(block: nn.Module, layer: int, site: str) -> nn.Module:
    """The module whose output is `site` of decoder block `layer`."""
    if site == "residual":
        return block
    for name in _ATTRIBUTES[site]:
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    raise HookPointError(f"layer {layer}: the block ({type(block).__name__}) has no {site} sub-block "
                         f"(looked for {', '.join(_ATTRIBUTES[site])})")


@contextmanager
def capture_sites(decoder_layers: Sequence[nn.Module], layers: Sequence[int], sites: Sequence[str],
                  sink: Callable[[int, str, torch.Tensor], None]) -> Iterator[None]:
    """During a forward inside the block, `sink(layer, site, hidden [B, T, d])` for every requested (layer, site);
    hooks are removed on exit, also on error."""
    layers = _check_layers(decoder_layers, layers)
    sites = check_sites(sites)
    with ExitStack() as stack:
        for layer in layers:
            for site in sites:
                module = site_module(decoder_layers[layer], layer, site)

                def hook(_module: nn.Module, _args: object, output: object, layer: int = layer,
                         site: str = site) -> None:
                    sink(layer, site, _hidden_of(output).detach())

                stack.callback(module.register_forward_hook(hook).remove)
        yield
