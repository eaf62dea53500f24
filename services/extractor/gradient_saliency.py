"""S2's gradients: the layer outputs' gradients of each passage's own log-likelihood, from one forward through the
decoder, the LM head in chunks (lm_head_likelihood) and one backward shared by every row and layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from poolbench.extractor.attention_capture import gradient_layer_outputs
from poolbench.extractor.layer_sinks import LayerExtras
from poolbench.extractor.lm_head_likelihood import final_hidden, layer_gradients, lm_head


def gradient_forward(model: nn.Module, decoder_layers: Sequence[nn.Module], inputs: dict, mask: torch.Tensor,
                     layers: tuple[int, ...], write: Callable[[int, torch.Tensor, LayerExtras], None]) -> None:
    """S2: forward to the final hidden state with the shallowest requested layer as a grad leaf (the backward stops
    there), and ONE backward of the sum of every row's log-likelihood: rows are independent, so each row's
    share of the gradient is its own gradient. Beside S2's token weights each layer hands "gradient_sum" [B, d],
    the gradient summed over the row's real tokens (first-order steerability, pooler.gradient_sums)."""
    lm_head(model)  # a model without an LM head fails here, before its forward
    with gradient_layer_outputs(decoder_layers, layers) as captured:
        final = final_hidden(model, inputs)
    tensors = [captured[layer] for layer in layers]
    grads = layer_gradients(model, final, tensors, inputs["input_ids"], mask)
    del final
    with torch.no_grad():
        for layer, hidden, grad in zip(layers, tensors, grads, strict=True):
            write(layer, hidden.detach(), {
                "gradient_norm": torch.linalg.vector_norm(grad.float(), dim=-1),
                "gradient_x_input": (grad.float() * hidden.float()).sum(-1).abs(),
                "gradient_sum": (grad.float() * mask[:, :, None]).sum(dim=1)})
