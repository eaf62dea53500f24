"""Learned token aggregators (the 2025-26 contenders): each scores every token of a passage with a small linear
readout and turns the scores into token weights, so its pooled vector is a weighted mean of the token states like
every other strategy's.

- attention probe: H learned queries, a softmax over tokens per query (optional per-head position bias), a linear
  head on each query's weighted sum (McKenzie et al., NeurIPS 2025; EleutherAI's attention probes, 2025);
- softmax probe: per-token logits, their softmax-weighted mean (McKenzie et al., NeurIPS 2025);
- MultiMax: H linear scores, each a hard max over tokens, summed (Kramár et al., arXiv 2601.11516, 2026);
- rolling max: per-token logits, means over a window of k tokens, the max window (same work).

`AggregatorBank` holds M independent aggregators of one kind (each its own grid point) and evaluates them all in
one batched pass: nested CV trains every (fold, grid point) pair at once, which on a CPU is what makes it cheap.
Inputs are right-padded token states Z [N, T, d] (standardised by the caller), a mask [N, T] of real tokens and
each token's relative position [N, T] in [0, 1]. Pure torch: no I/O, no store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("attention", "softmax", "multimax", "rolling")
_NEG = -1e9


@dataclass(frozen=True)
class AggregatorParams:
    """One point of a learned aggregator's hyperparameter grid (what nested CV chooses among)."""

    heads: int = 1
    position_bias: bool = False
    window: int = 1
    temperature: float = 1.0

    def describe(self) -> dict[str, int | float | bool]:
        return {"heads": self.heads, "position_bias": self.position_bias, "window": self.window,
                "temperature": self.temperature}


class AggregatorBank(nn.Module):
    """M aggregators of one kind, model m at grid point points[m]; `logits` [M, N] for training, `token_weights`
    [M, N, T] (rows summing to 1 over real tokens) for pooling."""

    def __init__(self, kind: str, dim: int, points: Sequence[AggregatorParams], seed: int = 0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown learned aggregator {kind!r} (known: {', '.join(KINDS)})")
        self.kind = kind
        self.points = list(points)
        m = len(self.points)
        heads = max(p.heads for p in self.points) if kind in ("attention", "multimax") else 1
        generator = torch.Generator().manual_seed(seed)
        self.score = nn.Parameter(torch.randn(m, heads, dim, generator=generator) * dim ** -0.5)
        self.value = nn.Parameter(torch.randn(m, heads, dim, generator=generator) * dim ** -0.5) \
            if kind == "attention" else None
        self.position = nn.Parameter(torch.zeros(m, heads))
        self.bias = nn.Parameter(torch.zeros(m))
        on = [[h < (p.heads if kind in ("attention", "multimax") else 1) for h in range(heads)] for p in self.points]
        self.register_buffer("head_on", torch.tensor(on, dtype=torch.float32))
        self.register_buffer("use_position", torch.tensor([float(p.position_bias) for p in self.points]))
        self.register_buffer("temperature", torch.tensor([p.temperature for p in self.points]))
        self.register_buffer("window", torch.tensor([p.window for p in self.points]))

    def head_groups(self) -> list[list[int]]:
        """The models grouped by their number of active heads (one group unless a grid mixes head counts)."""
        counts = [int(c) for c in self.head_on.sum(dim=1).tolist()]
        return [[m for m, c in enumerate(counts) if c == h] for h in sorted(set(counts))]

    def select(self, models: Sequence[int]) -> AggregatorBank:
        """A bank of those models only, each with the parameters it has here, and no more heads than they use.
        The models are independent (each its own loss term, its own L2 term, elementwise Adam), so training them
        apart is training them here, without the compute of the heads they switch off (1-head models in a bank
        sized for 4 spend 4 heads' matrix products on every step)."""
        bank = AggregatorBank(self.kind, self.score.shape[-1], [self.points[m] for m in models])
        index = torch.as_tensor(list(models), dtype=torch.long)
        heads = bank.score.shape[1]
        with torch.no_grad():
            bank.score.copy_(self.score[index, :heads])
            if self.value is not None and bank.value is not None:
                bank.value.copy_(self.value[index, :heads])
            bank.position.copy_(self.position[index, :heads])
            bank.bias.copy_(self.bias[index])
        return bank.to(self.score.device)

    def readout_weights(self) -> list[nn.Parameter]:
        """The parameters L2 applies to."""
        return [self.score] + ([self.value] if self.value is not None else [])

    def token_scores(self, Z: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[M, N, H, T] scores, padding (and unused heads' tokens) at a large negative value."""
        s = torch.einsum("ntd,mhd->mnht", Z, self.score)
        bias = (self.position * self.use_position[:, None])[:, None, :, None] * position[None, :, None, :]
        return (s + bias).masked_fill(~mask[None, :, None, :], _NEG)

    def logits(self, Z: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[M, N] every model's passage logits."""
        s = self.token_scores(Z, mask, position)
        on = self.head_on[:, None, :]  # [M, 1, H]
        if self.kind == "attention":
            assert self.value is not None
            alpha = torch.softmax(s, dim=-1)
            values = torch.einsum("ntd,mhd->mnht", Z, self.value)
            out = ((alpha * values).sum(dim=-1) * on).sum(dim=-1)
        elif self.kind == "softmax":
            s0 = s[:, :, 0]
            alpha = torch.softmax(s0 / self.temperature[:, None, None], dim=-1)
            out = (alpha * s0.masked_fill(~mask[None], 0.0)).sum(dim=-1)
        elif self.kind == "multimax":
            out = (s.amax(dim=-1) * on).sum(dim=-1)
        else:
            out = window_means(s[:, :, 0], mask, self.window).amax(dim=-1)
        return out + self.bias[:, None]

    @torch.no_grad()
    def token_weights(self, Z: torch.Tensor, mask: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[M, N, T] non-negative weights summing to 1 over each passage's real tokens."""
        s = self.token_scores(Z, mask, position)
        on = self.head_on[:, None, :, None] / self.head_on.sum(dim=1)[:, None, None, None]
        if self.kind == "attention":
            weights = (torch.softmax(s, dim=-1) * on).sum(dim=2)
        elif self.kind == "softmax":
            weights = torch.softmax(s[:, :, 0] / self.temperature[:, None, None], dim=-1)
        elif self.kind == "multimax":
            weights = (nn.functional.one_hot(s.argmax(dim=-1), s.shape[-1]).float() * on).sum(dim=2)
        else:
            weights = best_window_weights(s[:, :, 0], mask, self.window)
        return torch.where(mask[None], weights, 0.0)


def _window_sizes(mask: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = mask.sum(dim=1)  # [N]
    k = torch.minimum(window[:, None], lengths[None, :]).clamp(min=1)  # [M, N]
    return lengths, k


def window_means(scores: torch.Tensor, mask: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """[M, N, T] mean score of the window of min(window[m], length) real tokens ending at each token; windows that
    do not fit inside the passage at a large negative value. Right padding is assumed."""
    lengths, k = _window_sizes(mask, window)
    cums = nn.functional.pad(torch.cumsum(scores.masked_fill(~mask[None], 0.0), dim=-1), (1, 0))  # [M, N, T+1]
    ends = torch.arange(scores.shape[-1], device=scores.device)[None, None, :]
    starts = (ends + 1 - k[..., None]).clamp(min=0)
    means = (cums[..., 1:] - cums.gather(-1, starts)) / k[..., None]
    valid = (ends >= k[..., None] - 1) & (ends < lengths[None, :, None])
    return means.masked_fill(~valid, _NEG)


def best_window_weights(scores: torch.Tensor, mask: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """[M, N, T] uniform weights over the highest-mean window of each passage (what rolling max reads)."""
    _, k = _window_sizes(mask, window)
    end = window_means(scores, mask, window).argmax(dim=-1)  # [M, N]
    t = torch.arange(scores.shape[-1], device=scores.device)[None, None, :]
    inside = (t <= end[..., None]) & (t > end[..., None] - k[..., None])
    return inside.float() / k[..., None].float()
