"""S2's LM head in chunks: the log-likelihood and the gradients at every requested layer equal those of the full
`log_softmax(logits.float())` path, and no [B, T, V] logits tensor is ever made."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import random_llama
from tolerances import assert_float32_close
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from poolbench.extractor import batching
from poolbench.extractor.attention_capture import gradient_layer_outputs
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.lm_head_likelihood import (
    LMHead,
    autograd_head_chunk,
    final_hidden,
    lm_head,
    log_likelihood_and_gradient,
    plain_head_chunk,
)
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import PaddedBatch

pytestmark = pytest.mark.numerics


def _weights(model, std: float = 0.2):
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, std)
    return model.eval().requires_grad_(False)


def tied_llama():
    torch.manual_seed(1)
    return _weights(LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=64, vocab_size=70,
                                                 tie_word_embeddings=True)))


def softcapped_gemma2():
    torch.manual_seed(2)
    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=60, final_logit_softcapping=1.5,
                          attn_implementation="eager")
    return _weights(Gemma2ForCausalLM(config))


def scaled_granite():
    torch.manual_seed(3)
    config = GraniteConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=64, vocab_size=60, logits_scaling=4.0)
    return _weights(GraniteForCausalLM(config))


def inputs_for(vocab: int, left: bool) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 9, dtype=torch.bool)
    for row, n in enumerate((9, 5, 2)):
        if left:
            mask[row, : 9 - n] = False
        else:
            mask[row, n:] = False
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask.long(), "position_ids": position_ids, "use_cache": False}, mask


def full_path(model, layers, inputs, mask):
    """The old path: the CausalLM's full logits and log_softmax in float32 over every position."""
    with torch.enable_grad(), gradient_layer_outputs(model.model.layers, layers) as captured:
        logits = model(**inputs).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)
        score = (picked * (mask[:, :-1] & mask[:, 1:])).sum()
        tensors = [captured[layer] for layer in layers]
        return score.detach(), torch.autograd.grad(score, tensors), tensors


def chunked_path(model, layers, inputs, mask, chunk_tokens):
    with torch.enable_grad(), gradient_layer_outputs(model.model.layers, layers) as captured:
        final = final_hidden(model, inputs)
        score, grad_final = log_likelihood_and_gradient(lm_head(model), final, inputs["input_ids"], mask,
                                                        chunk_tokens=chunk_tokens)
        tensors = [captured[layer] for layer in layers]
        return score, torch.autograd.grad(final, tensors, grad_outputs=grad_final)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir), device="cpu").model


@pytest.mark.parametrize("which", ["tiny", "random_llama", "tied_llama", "gemma2_softcap", "granite_scaled"])
@pytest.mark.parametrize("left", [False, True])
def test_chunked_head_equals_full_log_softmax(which: str, left: bool, request) -> None:
    model = {"tiny": lambda: request.getfixturevalue("tiny"), "random_llama": random_llama,
             "tied_llama": tied_llama, "gemma2_softcap": softcapped_gemma2, "granite_scaled": scaled_granite}[which]()
    _compare(model, left, which)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_head_equals_full_log_softmax_on_cuda() -> None:
    """The CPU test's twin on the GPU (float32, TF32 off by torch's default), with the same derived bound."""
    _compare(random_llama().cuda(), True, "cuda")


def _compare(model, left: bool, which: str) -> None:
    config = model.config
    layers = tuple(range(config.num_hidden_layers))
    inputs, mask = inputs_for(config.vocab_size, left)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    mask = mask.to(device)
    want_score, want_grads, tensors = full_path(model, layers, inputs, mask)
    got_score, got_grads = chunked_path(model, layers, inputs, mask, chunk_tokens=4)  # 8 + 4 + 1 pairs: 4 chunks
    n_pairs, vocab, d = int((mask[:, :-1] & mask[:, 1:]).sum()), config.vocab_size, config.hidden_size
    # s = Σ_t (logit_t[x] - lse_t), every term negative, so every partial sum and term is at most |s| in size: the
    # n_pairs additions, each logit's d roundings (another matmul blocking) and each log-sum-exp's V roundings.
    assert_float32_close(got_score.cpu(), want_score.cpu(), terms=d + vocab + n_pairs, scale=abs(float(want_score)),
                         err_msg="score")
    # Gradients: the head's ds/dh sums V products (|softmax - onehot| sums to ≤ 2), then both paths run the same
    # backward through the blocks (d, MLP width and T positions per block); scale: the layer's largest
    # gradient norm, as in test_batched_saliency.
    blocks = config.num_hidden_layers
    chain = vocab + d + blocks * (d + config.intermediate_size + mask.shape[1])
    for layer, got, want, state in zip(layers, got_grads, want_grads, tensors, strict=True):
        scale = float(want.norm(dim=-1).max())
        assert scale > 0
        assert_float32_close(got.cpu().numpy(), want.cpu().numpy(), terms=chain, scale=scale,
                             err_msg=f"{which} layer {layer}")
        assert_float32_close((got * state).sum(-1).detach().cpu().numpy(),
                             (want * state).sum(-1).detach().cpu().numpy(),
                             terms=chain, scale=scale * float(state.detach().norm(dim=-1).max()),
                             err_msg=f"{which} g.x layer {layer}")


def test_softcap_and_scaling_reach_the_head() -> None:
    assert lm_head(softcapped_gemma2()).softcap == 1.5
    assert lm_head(scaled_granite()).multiplier == 0.25
    tied = tied_llama()
    head = lm_head(tied)
    assert head.softcap is None and head.multiplier == 1.0
    assert head.weight.data_ptr() == tied.get_input_embeddings().weight.data_ptr()  # tied: the embeddings


class LargestVocabTensor(TorchDispatchMode):
    """The most rows any tensor with a last dimension of the vocabulary's size had (outputs of every op, views of
    the head's own weight, such as its transpose, aside)."""

    def __init__(self, vocab: int, weight: torch.Tensor) -> None:
        super().__init__()
        self.vocab, self.rows, self.weight = vocab, 0, weight.untyped_storage().data_ptr()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.vocab \
                    and tensor.untyped_storage().data_ptr() != self.weight:
                self.rows = max(self.rows, math.prod(tensor.shape[:-1]))
        return out


def test_s2_capture_never_holds_logits_for_every_token(monkeypatch) -> None:
    torch.manual_seed(4)
    vocab = 3001
    model = _weights(LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=2, intermediate_size=32, vocab_size=vocab)))
    rows, length = 4, 16
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(6)).numpy()
    mask = np.ones((rows, length), dtype=bool)
    batch = PaddedBatch(list(range(rows)), [f"p{r}" for r in range(rows)], ["x"] * rows, ids, mask,
                        np.zeros((rows, length, 2), np.int32), np.zeros((rows, length), bool))
    chunk = 8
    monkeypatch.setattr(batching, "HEAD_CHUNK_BYTES", chunk * vocab * batching.HEAD_BYTES_PER_LOGIT)
    with LargestVocabTensor(vocab, model.lm_head.weight) as seen:
        out = next(extract_batches(model, model.model.layers, [batch], (0, 1), needs={"gradient"},
                                   max_batch_tokens=rows * length))
    assert out.extras["gradient_norm"].shape == (2, rows, length)
    # at most one chunk of 8 (t, t+1) pairs has logits at a time; the full path makes [4, 16, V] (64 rows)
    assert 0 < seen.rows <= chunk


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plain_head_gradient_is_autograds_bit_for_bit(dtype: torch.dtype) -> None:
    """The in-place gradient of a head without softcap or scale equals autograd's through the same logits bit for
    bit (score and every gradient element, -0.0 included), also where exp(logit - lse) underflows to 0 (a row of
    the weight scaled up) and for a bfloat16 model (the float32 logits' gradient cast back before W)."""
    generator = torch.Generator().manual_seed(8)
    vocab, width, n = 5000, 48, 300
    weight = (torch.randn(vocab, width, generator=generator) * 0.1)
    weight[7] *= 60  # logits far below the log-sum-exp on some rows: their probabilities are exactly 0
    head = LMHead(weight.to(dtype), torch.randn(vocab, generator=generator).to(dtype), None, 1.0)
    h = (torch.randn(n, width, generator=generator) * 4).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=generator)
    ref_score, ref_grad = autograd_head_chunk(head, h, targets)
    score, grad = plain_head_chunk(head, h, targets)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(score.view(torch.int32), ref_score.view(torch.int32))
    assert torch.equal(grad.view(bits), ref_grad.view(bits))
    probabilities = torch.softmax(torch.nn.functional.linear(h, head.weight, head.bias).float(), dim=-1)
    assert (probabilities == 0).any()  # the underflow case is really exercised


def test_a_softcapped_or_scaled_head_takes_the_autograd_path(monkeypatch) -> None:
    """Should-fail guard: the in-place path knows no softcap or scale, so such heads never reach it."""
    import poolbench.extractor.lm_head_likelihood as likelihood

    def refuse(*_args):
        raise AssertionError("plain_head_chunk used for a head with softcap or scale")

    monkeypatch.setattr(likelihood, "plain_head_chunk", refuse)
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(9))
    ids, mask = torch.randint(0, 60, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    for model in (softcapped_gemma2(), scaled_granite()):
        log_likelihood_and_gradient(lm_head(model), hidden, ids, mask)
    with pytest.raises(AssertionError, match="plain_head_chunk used"):
        log_likelihood_and_gradient(lm_head(tied_llama()), hidden, torch.randint(0, 70, (2, 5)), mask)
