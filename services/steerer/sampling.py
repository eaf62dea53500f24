"""Per-row seeded sampling inside one batched generate call, drawn on the model's device.

`RowSeededSampler` is a LogitsProcessor used with greedy decoding: it returns scores / T + Gumbel noise, whose
argmax is an exact draw from softmax(scores / T) (the Gumbel-max trick). The noise is a counter-based hash of
(row seed, step, token id) in int32/int64 torch ops, vectorised over rows, on the scores' device, in fp32: no
generator state, no host loop, nothing shipped from the CPU. A row's noise depends on its seed and the step
only, so it is the same whatever else shares the batch; the logits it is added to are batch-invariant only
when the row sees the same padding and batch shape (see transformers_backend.prompt_group_chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessor


def _signed(value: int, bits: int) -> int:
    """An unsigned constant as the two's-complement value torch's signed integer tensors hold."""
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


_GOLDEN64 = _signed(0x9E3779B97F4A7C15, 64)
_MIX64 = (_signed(0xBF58476D1CE4E5B9, 64), _signed(0x94D049BB133111EB, 64))
_GOLDEN32 = _signed(0x9E3779B9, 32)
_MIX32 = (_signed(0x85EBCA6B, 32), _signed(0xC2B2AE35, 32))
UNIFORM_BITS = 23  # (k + 0.5) / 2^23 and 1 minus it are exact in fp32, so log1p never sees 0 or 1


def _shift_right(x: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Logical right shift on a signed tensor (torch shifts arithmetically)."""
    return (x >> k) & ((1 << (bits - k)) - 1)


def _xorshift_multiply(x: torch.Tensor, shifts: tuple[int, int, int], multipliers: tuple[int, int],
                       bits: int) -> torch.Tensor:
    """The finaliser shape SplitMix64 and MurmurHash3 share: xor-shift, multiply, xor-shift, multiply, xor-shift.
    The first step makes a new tensor and the rest work in place on it (`x` is left as it was): over the
    sampler's [rows, vocab] every out-of-place step allocated and filled another such tensor."""
    x = x ^ _shift_right(x, shifts[0], bits)
    x *= multipliers[0]
    x ^= _shift_right(x, shifts[1], bits)
    x *= multipliers[1]
    x ^= _shift_right(x, shifts[2], bits)
    return x


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (multiplication wraps): a bijection with full avalanche."""
    return _xorshift_multiply(x, (30, 27, 31), _MIX64, 64)


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int32: half the memory traffic of 64-bit mixing over [rows, vocab]."""
    return _xorshift_multiply(x, (16, 13, 16), _MIX32, 32)


def row_keys(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One int32 key per row from (seed, step): a 64-bit hash chain folded to its low 32 bits."""
    step_key = splitmix64(torch.tensor(int(step), dtype=torch.int64, device=seeds.device) * _GOLDEN64)
    x = splitmix64(splitmix64(seeds.to(torch.int64) * _GOLDEN64 + 1) ^ step_key)
    low = x & 0xFFFFFFFF
    return torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32)


def token_keys(vocab: int, device: torch.device | str) -> torch.Tensor:
    """One int32 key per token id, hashed once per vocabulary and device."""
    ids = torch.arange(vocab, dtype=torch.int32, device=device)
    return fmix32(ids * _GOLDEN32 + 1)


def uniform_noise(seeds: torch.Tensor, step: int, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1), fp32, from (seed, step, token id): the same numbers on every device.
    The shift and the scaling work in place (out-of-place steps over [rows, vocab] made the sampler a sixth of the
    default run's generation time on CPU)."""
    k = fmix32(tokens[None, :] ^ row_keys(seeds, step)[:, None])
    k >>= 32 - UNIFORM_BITS  # _shift_right in place: fmix32's result is this call's own tensor
    k &= (1 << UNIFORM_BITS) - 1
    return k.to(torch.float32).add_(0.5).mul_(2.0 ** -UNIFORM_BITS)


def gumbel_noise(seeds: torch.Tensor, step: int, tokens: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(E), E = -log1p(-u) ~ Exp(1): the high tail (small u) keeps full precision.
    In place on the uniforms' tensor."""
    return uniform_noise(seeds, step, tokens).neg_().log1p_().neg_().log_().neg_()


class RowSeededSampler(LogitsProcessor):
    """Gumbel-max sampling with one seed per row; the step is the number of calls so far (one per new token)."""

    def __init__(self, seeds: Sequence[int], temperature: float) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        self.temperature = float(temperature)
        self.seeds = torch.tensor([int(s) for s in seeds], dtype=torch.int64)
        self.step = 0
        self._tokens: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"batch of {scores.shape[0]} rows for {len(self.seeds)} seeds")
        vocab, device = scores.shape[-1], scores.device
        if self._tokens is None or self._tokens.shape[0] != vocab or self._tokens.device != device:
            self._tokens = token_keys(vocab, device)
            self.seeds = self.seeds.to(device)
        noise = gumbel_noise(self.seeds, self.step, self._tokens)
        self.step += 1
        return scores.float() / self.temperature + noise


class StepCounter(LogitsProcessor):
    """Calls `on_step()` once per decoding step and leaves the scores untouched: progress, never a change."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.on_step()
        return scores
