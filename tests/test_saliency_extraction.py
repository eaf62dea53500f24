"""Extraction extras: attention inflow against eager attention maps, gradients against an independent autograd
pass through HF's hidden_states, and nothing extra computed unless a strategy needs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from tolerances import assert_float32_close
from transformers import BertConfig, BertModel, LlamaForCausalLM

from poolbench.errors import ExtractionError
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.padded_batches import PaddedBatch

LAYERS = (0, 2)
# Roundings in a forward or backward through the 3 layers of random_llama: each sums over the hidden size (32),
# the MLP width (64) and the 7 positions (tests/tolerances.py).
CHAIN_TERMS = 3 * (32 + 64 + 7)

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return random_llama()


def padded(left: bool) -> PaddedBatch:
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1)).numpy()
    mask = np.ones((2, 7), dtype=bool)
    if left:
        mask[1, :2] = False
    else:
        mask[1, 5:] = False
    return PaddedBatch([0, 1], ["a", "b"], ["x", "y"], ids, mask, np.zeros((2, 7, 2), np.int32),
                       np.zeros((2, 7), bool))


def reference_forward(model, batch: PaddedBatch, **kwargs):
    mask = torch.from_numpy(batch.attention_mask).long()
    return model(input_ids=torch.from_numpy(batch.input_ids), attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **kwargs)


@pytest.mark.parametrize("left", [False, True])
def test_attention_inflow_matches_eager_attention_maps(llama, left: bool) -> None:
    batch = padded(left)
    out = next(extract_batches(llama, llama.model.layers, [batch], LAYERS, needs={"attention", "labels"}))
    previous = llama.config._attn_implementation
    llama.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            maps = reference_forward(llama, batch, output_attentions=True).attentions
    finally:
        llama.config._attn_implementation = previous
    mask = torch.from_numpy(batch.attention_mask)
    last = [6, 6] if left else [6, 4]
    for i, layer in enumerate(LAYERS):
        attn = maps[layer]  # [B, H, T, T]
        queries = mask[:, None, :, None].float()
        inflow = (attn * queries).sum(2) / queries.sum(2)
        # attention weights are probabilities (<= 1) at the end of the forward chain: its round-off of scale 1
        probability = {"terms": CHAIN_TERMS, "scale": 1.0}
        assert_float32_close(out.extras["attention_head_inflow"][i], inflow.numpy(), **probability)
        assert_float32_close(out.extras["attention_inflow"][i], inflow.mean(1).numpy(), **probability)
        last_rows = attn[torch.arange(2), :, last]
        assert_float32_close(out.extras["attention_head_inflow_last"][i], last_rows.numpy(), **probability)
        assert_float32_close(out.extras["attention_inflow"][i].sum(-1), [1, 1], **probability)
    assert out.extras["attention_head_output_last"].shape == (2, 2, 4, 8)
    assert llama.config._attn_implementation == previous  # restored after the capture


def test_head_output_is_the_heads_weighted_sum_of_values(llama) -> None:
    batch = padded(False)
    out = next(extract_batches(llama, llama.model.layers, [batch], (1,), needs={"attention", "labels"}))
    captured = {}
    attn = llama.model.layers[1].self_attn
    handle = attn.o_proj.register_forward_pre_hook(lambda m, args: captured.setdefault("z", args[0]))
    try:
        with torch.no_grad():
            reference_forward(llama, batch)
    finally:
        handle.remove()
    z = captured["z"].reshape(2, 7, 4, 8)  # o_proj input: heads' outputs side by side
    np.testing.assert_allclose(out.extras["attention_head_output_last"][0], z[[0, 1], [6, 4]].numpy(),
                               atol=1e-5)


@pytest.mark.parametrize("left", [False, True])
def test_gradient_saliency_matches_autograd_through_hf_hidden_states(llama, left: bool) -> None:
    batch, layers = padded(left), (0, 1)  # HF's last hidden_states entry is final-normed, so not layer 2
    out = next(extract_batches(llama, llama.model.layers, [batch], layers, needs={"gradient"}))
    plain = next(extract_batches(llama, llama.model.layers, [batch], layers))
    assert_float32_close(out.hidden, plain.hidden, terms=CHAIN_TERMS)  # the same forward, with grad on or off
    with torch.enable_grad():
        embeds = llama.model.embed_tokens(torch.from_numpy(batch.input_ids)).detach().requires_grad_(True)
        mask = torch.from_numpy(batch.attention_mask)
        result = llama(inputs_embeds=embeds, attention_mask=mask.long(),
                       position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0), output_hidden_states=True)
        states = [result.hidden_states[layer + 1] for layer in layers]  # layers.L.out
        logp = torch.log_softmax(result.logits[:, :-1], -1).gather(
            -1, torch.from_numpy(batch.input_ids)[:, 1:, None])[..., 0]
        score = (logp * (mask[:, :-1] & mask[:, 1:])).sum()
        grads = torch.autograd.grad(score, states)
    for i, (grad, state) in enumerate(zip(grads, states, strict=True)):
        # Two backward passes in different orders: round-off of the chain relative to the largest gradient norm
        # (attention mixes positions' gradients), and for g·x relative to its terms' size ‖g‖·‖x_t‖, since g·x
        # may cancel to ~0 (as test_batched_saliency explains).
        g_max = float(grad.norm(dim=-1).max())
        assert_float32_close(out.extras["gradient_norm"][i], grad.norm(dim=-1).numpy(), terms=CHAIN_TERMS,
                             scale=g_max)
        assert_float32_close(out.extras["gradient_x_input"][i], (grad * state).sum(-1).abs().detach().numpy(),
                             terms=CHAIN_TERMS, scale=g_max * state.detach().norm(dim=-1).numpy())
    real_last = (6, 6) if left else (6, 4)
    assert out.extras["gradient_norm"][:, [0, 1], real_last].max() == 0  # the last token predicts nothing
    assert (out.extras["gradient_norm"][:, ~batch.attention_mask] == 0).all()


def test_extras_are_computed_only_when_needed(llama) -> None:
    plain = next(extract_batches(llama, llama.model.layers, [padded(False)], LAYERS))
    assert plain.extras == {}
    attention = next(extract_batches(llama, llama.model.layers, [padded(False)], LAYERS, needs={"attention"}))
    assert set(attention.extras) == {"attention_head_inflow", "attention_head_inflow_last",
                                     "attention_inflow", "attention_inflow_last"}
    assert attention.extras["attention_inflow"].shape == (2, 2, 7)  # only the requested layers


def test_encoder_attention_works_and_gradient_is_refused_in_one_line() -> None:
    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=50)
    bert = BertModel(config).eval().requires_grad_(False)
    out = next(extract_batches(bert, bert.encoder.layer, [padded(False)], (1,), needs={"attention"}))
    assert_float32_close(out.extras["attention_inflow"][0].sum(-1), [1, 1], terms=CHAIN_TERMS, scale=1.0)
    assert out.extras["attention_inflow"][0, 1, 5:].max() == 0  # padding keys receive nothing
    with pytest.raises(ExtractionError, match=r"^BertModel has no LM head: gradient saliency \(S2\)"):
        next(extract_batches(bert, bert.encoder.layer, [padded(False)], (1,), needs={"gradient"}))
