"""S2's gradients: the layer outputs' gradients of each passage's own log-likelihood, from one forward through the
decoder, the LM head in chunks (lm_head_likelihood) and one backward shared by every row and layer; each layer is
handed on inside that backward, as soon as its gradient is complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from poolbench.extractor.attention_capture import gradient_layer_outputs
from poolbench.extractor.layer_sinks import LayerExtras
from poolbench.extractor.lm_head_likelihood import Pairs, final_hidden, layer_gradients, lm_head

Write = Callable[[int, torch.Tensor, LayerExtras], None]


def gradient_forward(model: nn.Module, decoder_layers: Sequence[nn.Module], inputs: dict, mask: torch.Tensor,
                     layers: tuple[int, ...], write: Write, pairs: Pairs | None = None) -> None:
    """S2: forward to the final hidden state with the shallowest requested layer as a grad leaf (the backward stops
    there), and ONE backward of the sum of every row's log-likelihood: rows are independent, so each row's
    share of the gradient is its own gradient. Beside S2's token weights each layer hands "gradient_norm",
    "gradient_x_input" [B, T] and "gradient_sum" [B, d], the gradient summed over the row's real tokens
    (first-order steerability, pooler.gradient_sums).

    Every layer above the shallowest is written from a hook on its output, which autograd calls once that
    output's gradient is whole, while the backward below it is still to run: its pooling is enqueued among the
    backward's kernels, where the host's launches hide behind the device's work, instead of 32 layers of pooling
    launched after a finished backward on an idle device. The shallowest, the leaf the backward stops at, is
    written last, from the backward's result. Each layer's values are the ones autograd.grad over every layer
    gave (tests/test_gradient_in_backward.py, bit for bit). `pairs`: the log-likelihood's terms from the batch's host
    mask (lm_head_likelihood.real_pairs_from_host), so nothing here waits for the device."""
    lm_head(model)  # a model without an LM head fails here, before its forward
    first = min(layers)
    with gradient_layer_outputs(decoder_layers, layers) as captured:
        final = final_hidden(model, inputs)
    hidden = captured.pop(first)
    handles = [output.register_hook(_written_from_its_gradient(layer, output, mask, write))
               for layer, output in captured.items()]
    captured.clear()
    try:
        (grad,) = layer_gradients(model, final, [hidden], inputs["input_ids"], mask, pairs=pairs)
    finally:
        for handle in handles:
            handle.remove()
    del final
    _write_layer(first, hidden, grad, mask, write)


def _written_from_its_gradient(layer: int, hidden: torch.Tensor, mask: torch.Tensor, write: Write
                               ) -> Callable[[torch.Tensor], None]:
    """A tensor hook that writes `layer` from its output's gradient, leaving the gradient as it is, and lets the
    output go (the hook is on the output's own node: holding it past its write would keep every layer's states to
    the backward's end)."""
    held = [hidden]

    def hook(grad: torch.Tensor) -> None:
        _write_layer(layer, held.pop(), grad, mask, write)

    return hook


def _write_layer(layer: int, hidden: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor, write: Write) -> None:
    with torch.no_grad():
        wide = grad.float()  # cast once for the three (at bf16 and 16 x 512 tokens of d 4,096: 134 MB a cast)
        write(layer, hidden.detach(), {
            "gradient_norm": torch.linalg.vector_norm(wide, dim=-1),
            # the product promotes the states to float32 element by element (exact), as a cast of them would
            "gradient_x_input": (wide * hidden).sum(-1).abs(),
            "gradient_sum": (wide * mask[:, :, None]).sum(dim=1)})
