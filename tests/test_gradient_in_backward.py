"""S2 hands each layer on inside its backward (gradient_saliency.gradient_forward): every layer above the shallowest
as soon as its gradient is whole, the shallowest from the backward's result; the values are autograd.grad's over
every layer, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from tolerances import assert_float32_close
from transformers import LlamaForCausalLM

from poolbench.errors import StrategyError
from poolbench.extractor import gradient_saliency
from poolbench.extractor.attention_capture import gradient_layer_outputs
from poolbench.extractor.gradient_saliency import gradient_forward
from poolbench.extractor.lm_head_likelihood import final_hidden, layer_gradients
from poolbench.extractor.padded_batches import PaddedBatch, model_inputs


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return random_llama()


def left_padded() -> PaddedBatch:
    ids = torch.randint(3, 50, (3, 8), generator=torch.Generator().manual_seed(4)).numpy()
    mask = np.ones((3, 8), dtype=bool)
    mask[1, :3] = False
    mask[2, :6] = False
    return PaddedBatch([0, 1, 2], ["a", "b", "c"], ["x"] * 3, ids, mask, np.zeros((3, 8, 2), np.int32),
                       np.zeros((3, 8), bool))


def after_the_backward(model, inputs, mask, layers) -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The reference (S2 until session 33): one autograd.grad over every layer's output, then each layer's extras."""
    with torch.enable_grad():
        with gradient_layer_outputs(model.model.layers, layers) as captured:
            final = final_hidden(model, inputs)
        tensors = [captured[layer] for layer in layers]
        grads = layer_gradients(model, final, tensors, inputs["input_ids"], mask)
    with torch.no_grad():
        return {layer: (hidden.detach(), {
            "gradient_norm": torch.linalg.vector_norm(grad.float(), dim=-1),
            "gradient_x_input": (grad.float() * hidden.float()).sum(-1).abs(),
            "gradient_sum": (grad.float() * mask[:, :, None]).sum(dim=1)})
            for layer, hidden, grad in zip(layers, tensors, grads, strict=True)}


def in_the_backward(model, inputs, mask, layers) -> list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]:
    written: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
    with torch.enable_grad():
        gradient_forward(model, model.model.layers, inputs, mask, layers,
                         lambda layer, hidden, extras: written.append((layer, hidden, dict(extras))))
    return written


@pytest.mark.parametrize(("layers", "dtype"), [((0, 1, 2), torch.float32), ((1, 2), torch.float32),
                                               ((2,), torch.float32), ((0, 1, 2), torch.bfloat16)])
def test_each_layer_equals_autograd_over_every_layer_bit_for_bit(llama, layers, dtype) -> None:
    model = llama if dtype == torch.float32 else random_llama().to(dtype)
    inputs = model_inputs(model, left_padded())
    mask = inputs["attention_mask"].to(torch.bool)
    expected = after_the_backward(model, inputs, mask, layers)
    written = in_the_backward(model, inputs, mask, layers)
    assert sorted(layer for layer, _, _ in written) == list(layers)  # each layer once, the shallowest too
    for layer, hidden, extras in written:
        want_hidden, want = expected[layer]
        assert torch.equal(hidden, want_hidden), layer
        assert extras.keys() == want.keys()
        for name, value in extras.items():
            assert torch.equal(value, want[name]), (layer, name)


def test_layers_above_the_shallowest_are_written_inside_the_backward(llama, monkeypatch) -> None:
    """Deepest first, each while the backward is still running; the shallowest after it returns."""
    events: list[object] = []

    def timed_backward(*args, **kwargs):
        events.append("backward starts")
        grads = layer_gradients(*args, **kwargs)
        events.append("backward returns")
        return grads

    monkeypatch.setattr(gradient_saliency, "layer_gradients", timed_backward)
    inputs = model_inputs(llama, left_padded())
    with torch.enable_grad():
        gradient_forward(llama, llama.model.layers, inputs, inputs["attention_mask"].to(torch.bool), (0, 1, 2),
                         lambda layer, hidden, extras: events.append(layer))
    assert events == ["backward starts", 2, 1, "backward returns", 0]


def test_a_sinks_error_inside_the_backward_keeps_its_type_and_leaves_no_hook(llama) -> None:
    inputs = model_inputs(llama, left_padded())
    mask = inputs["attention_mask"].to(torch.bool)
    calls: list[int] = []

    def failing(layer: int, hidden: torch.Tensor, extras) -> None:
        calls.append(layer)
        raise StrategyError(f"layer {layer}: weights must be finite and non-negative")

    with torch.enable_grad(), pytest.raises(StrategyError, match="layer 2"):
        gradient_forward(llama, llama.model.layers, inputs, mask, (0, 2), failing)
    assert calls == [2]
    assert [layer for layer, _, _ in in_the_backward(llama, inputs, mask, (0, 2))] == [2, 0]  # no stale hook


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_layers_are_written_in_the_backward_with_autograds_values() -> None:
    """On CUDA (where autograd runs a device's backward on a thread of its own) the layers are written deepest
    first, the shallowest after the backward, and each equals autograd.grad over every layer on the same device
    (within the chain's float32 bound: CUDA's attention backward may sum in another order from run to run)."""
    model = random_llama().cuda()
    inputs = model_inputs(model, left_padded())
    mask = inputs["attention_mask"].to(torch.bool)
    expected = after_the_backward(model, inputs, mask, (0, 1, 2))
    written = in_the_backward(model, inputs, mask, (0, 1, 2))
    assert [layer for layer, _, _ in written] == [2, 1, 0]
    terms = 3 * (32 + 64 + 8)  # the 3 blocks' sums over the hidden size, the MLP width and the positions
    for layer, hidden, extras in written:
        want_hidden, want = expected[layer]
        assert torch.equal(hidden, want_hidden), layer
        for name, value in extras.items():
            assert_float32_close(value.cpu(), want[name].cpu(), terms=terms, err_msg=f"{layer} {name}")
