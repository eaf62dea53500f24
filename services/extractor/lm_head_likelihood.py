"""The passage log-likelihood and its gradient at the final hidden state, with the LM head run over chunks of tokens.

The full path (`model(...).logits` then `log_softmax(logits.float())`) holds, per token, the logits in the model's
dtype, a float32 copy and the saved log-softmax over the whole vocabulary: with 128k words that outweighs an 8B
model's saved graph. Here the model runs to its final (normed) hidden state h; then, over chunks of the real
(t, t+1) pairs, logits = head(h_t) in the model's dtype exactly as the model computes them (softcapping and logit
scaling included), log p = logit[target] - logsumexp in float32, and d s / d h_t by autograd on that chunk alone
(recomputed, never kept). One `torch.autograd.grad(h, tensors, grad_outputs=dh)` then carries the gradient down to
the requested layers. Peak extra memory is one chunk × vocab, never [B, T, V] in float32. The model's own forward
runs (wrappers too), the head's input taken by a pre-hook and the head handed one position: `logits_to_keep` is
left at the model's default (every position), which is what the hook needs to see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from poolbench.errors import ExtractionError
from poolbench.extractor.batching import chunk_tokens_for
from poolbench.extractor.logsumexp_rows import logsumexp_rows
from poolbench.extractor.model_config import text_config
from poolbench.extractor.padded_batches import host_to_device


@dataclass(frozen=True)
class LMHead:
    """The part of a causal LM after its decoder: logits = transform(h @ weight^T + bias)."""

    weight: torch.Tensor  # [V, d] (the input embeddings when tied: the same tensor)
    bias: torch.Tensor | None
    softcap: float | None  # Gemma 2/3: logits = tanh(logits / cap) * cap
    multiplier: float  # Cohere's logit_scale; 1 / Granite's logits_scaling

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own logits for these hidden states, in the model's dtype, in the model's order of ops."""
        logits = nn.functional.linear(hidden, self.weight, self.bias)
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def causal_lm(model: nn.Module) -> nn.Module:
    """The module that owns the LM head: the model itself, or the causal LM a wrapper holds."""
    for module in model.modules():
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        if isinstance(getattr(head, "weight", None), torch.Tensor):
            return module
    raise ExtractionError(f"{type(model).__name__} has no LM head: gradient saliency (S2) "
                          "needs a causal LM's log-likelihood")


def lm_head(model: nn.Module) -> LMHead:
    """The model's LM head, or one line saying it has none (S2 needs a causal LM's log-likelihood)."""
    owner = causal_lm(model)
    head = owner.get_output_embeddings()  # type: ignore[operator]
    text = text_config(owner)
    softcap = getattr(text, "final_logit_softcapping", None)
    multiplier = float(getattr(text, "logit_scale", None) or 1.0) / float(getattr(text, "logits_scaling", None) or 1.0)
    return LMHead(head.weight, getattr(head, "bias", None), float(softcap) if softcap else None, multiplier)


def final_hidden(model: nn.Module, inputs: dict) -> torch.Tensor:
    """What the model feeds its LM head [B, T, d] (after the final norm), from the model's own forward: a
    pre-hook on the head takes it and hands the head only the first position, so no [B, T, V] logits exist."""
    head = causal_lm(model).get_output_embeddings()  # type: ignore[operator]
    seen: list[torch.Tensor] = []

    def take(_module: nn.Module, args: tuple) -> tuple:
        seen.append(args[0])
        return (args[0][..., :1, :], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        model(**inputs)
    finally:
        handle.remove()
    length = inputs["input_ids" if "input_ids" in inputs else "inputs_embeds"].shape[1]
    if len(seen) != 1 or seen[0].shape[1] != length:
        raise ExtractionError(f"{type(model).__name__}: the LM head saw {[tuple(h.shape) for h in seen]}, not one "
                              f"[B, {length}, d] call; S2 cannot read the log-likelihood's hidden states")
    return seen[0]


Pairs = tuple[torch.Tensor, torch.Tensor]  # (rows, positions) of the log-likelihood's terms, row-major


def real_pairs(mask: torch.Tensor) -> Pairs:
    """(rows, positions) of every t whose token and next token are both real: the terms of the log-likelihood.
    On a GPU `nonzero` waits for the device's queue (its count sizes the result): the capture hands
    real_pairs_from_host's instead."""
    pairs = mask[:, :-1] & mask[:, 1:]
    rows, positions = torch.nonzero(pairs, as_tuple=True)
    return rows, positions


def real_pairs_from_host(mask: np.ndarray, device: torch.device) -> Pairs:
    """real_pairs from the batch's host mask, the same indices in the same order (numpy's nonzero is row-major as
    torch's is), sent to the device without waiting: the capture enqueues a chunk's LM head and backward behind
    its forward, and a device nonzero there held the host until that forward had run."""
    real = np.asarray(mask).astype(bool, copy=False)
    found = np.nonzero(real[:, :-1] & real[:, 1:])
    rows, positions = (host_to_device(index.astype(np.int64, copy=False), device) for index in found)
    return rows, positions


def log_likelihood_and_gradient(head: LMHead, hidden: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                                *, chunk_tokens: int | None = None, pairs: Pairs | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, ds/dh): s = sum over rows of log p(x_{t+1} | x_<=t) over real pairs (float32 scalar), and its gradient
    at `hidden` [B, T, d] (hidden's dtype; zero where t has no real successor), one chunk of pairs at a time.
    `pairs`: real_pairs(mask) computed already (real_pairs_from_host), or None to compute them here."""
    chunk = chunk_tokens or chunk_tokens_for(head.weight.shape[0])
    rows, positions = pairs if pairs is not None else real_pairs(mask.to(torch.bool))
    targets = input_ids[rows, positions + 1]
    flat_index = rows * hidden.shape[1] + positions
    states = hidden.detach().reshape(-1, hidden.shape[-1])
    grad = torch.zeros_like(states)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    plain = head.softcap is None and head.multiplier == 1.0
    for start in range(0, int(flat_index.numel()), chunk):
        index = flat_index[start:start + chunk]
        chunk_targets = targets[start:start + chunk]
        score, part = (plain_head_chunk if plain else autograd_head_chunk)(head, states[index], chunk_targets)
        grad[index] = part
        total = total + score
    return total, grad.reshape(hidden.shape)


def autograd_head_chunk(head: LMHead, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(target), its gradient at h) for one chunk, by autograd through the head's own logits (any
    softcap or scale): the reference plain_head_chunk is held to."""
    with torch.enable_grad():
        h = h.detach().requires_grad_(True)
        logits = head.logits(h).float()
        picked = logits.gather(-1, targets[:, None]).squeeze(-1)
        score = (picked - torch.logsumexp(logits, dim=-1)).sum()
        (part,) = torch.autograd.grad(score, [h])
    return score.detach(), part


def plain_head_chunk(head: LMHead, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """autograd_head_chunk for a head without softcap or scale, bit for bit, in a third fewer passes over the
    [chunk, vocabulary] logits: d/dlogits = onehot(target) - exp(logits - lse) formed in place in the logits'
    own buffer, in the very operations autograd runs (logsumexp's backward is grad * exp(x - lse) with grad -1; the
    gather's is a scatter of ones; the cast's, a cast back), then the linear's backward, grad @ W. Autograd's
    version allocated a zeroed [chunk, V] tensor for the gather and two more for logsumexp's backward: ~0.4 s of
    every 1,024 tokens of SmolLM2's 49k-word head on this CPU (bench/README.md). The log-sum-exp itself is
    logsumexp_rows: torch.logsumexp's bits where each thread's share is whole SIMD vectors (its docstring)."""
    with torch.no_grad():
        raw = head.logits(h)
        logits = raw.float()  # the same tensor for a float32 model: the in-place steps below then reuse it
        picked = logits.gather(-1, targets[:, None]).squeeze(-1)
        lse = logsumexp_rows(logits)
        score = (picked - lse).sum()
        grad_logits = logits.sub_(lse[:, None]).exp_().neg_()
        grad_logits.scatter_add_(-1, targets[:, None], torch.ones_like(picked)[:, None])
        part = grad_logits.to(raw.dtype).mm(head.weight)
    return score, part


def layer_gradients(model: nn.Module, final: torch.Tensor, tensors: Sequence[torch.Tensor], input_ids: torch.Tensor,
                    mask: torch.Tensor, *, chunk_tokens: int | None = None, pairs: Pairs | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """d s / d t for each of `tensors` (upstream of `final`, the decoder's last hidden state): the chunked head's
    gradient at `final`, then one backward through the decoder shared by every row and tensor."""
    _, grad_final = log_likelihood_and_gradient(lm_head(model), final, input_ids, mask, chunk_tokens=chunk_tokens,
                                                pairs=pairs)
    return torch.autograd.grad(final, list(tensors), grad_outputs=grad_final)
