"""S2's gradients: the layer outputs' gradients of each passage's own log-likelihood, from one forward to the LM
head and one backward shared by every row and layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from poolbench.errors import ExtractionError
from poolbench.extractor.attention_capture import gradient_layer_outputs, passage_log_likelihood
from poolbench.extractor.layer_sinks import LayerExtras


def gradient_forward(model: nn.Module, decoder_layers: Sequence[nn.Module], inputs: dict, mask: torch.Tensor,
                     layers: tuple[int, ...], write: Callable[[int, torch.Tensor, LayerExtras], None]) -> None:
    """S2: forward to the LM head with the shallowest requested layer as a grad leaf (the backward stops
    there), and ONE backward of the sum of every row's log-likelihood: rows are independent, so each row's
    share of the gradient is its own gradient. Beside S2's token weights each layer hands "gradient_sum" [B, d],
    the gradient summed over the row's real tokens (first-order steerability, pooler.gradient_sums)."""
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
                "gradient_x_input": (grad.float() * hidden.float()).sum(-1).abs(),
                "gradient_sum": (grad.float() * mask[:, :, None]).sum(dim=1)})
