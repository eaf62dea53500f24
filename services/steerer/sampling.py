"""Per-prompt seeded sampling inside one batched generate call.

`RowSeededSampler` is a LogitsProcessor used with greedy decoding: it turns each row's scores into
log_softmax(scores / T) + Gumbel noise drawn from that row's own torch.Generator. The argmax of logits
plus Gumbel(0, 1) noise is an exact sample from softmax(logits / T) (the Gumbel-max trick), so greedy
decoding of the processed scores samples each row from its own seeded stream: a prompt's continuation does
not depend on which other prompts share its batch (up to float round-off in the batched forward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessor


class RowSeededSampler(LogitsProcessor):
    def __init__(self, seeds: Sequence[int], temperature: float) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        self.temperature = float(temperature)
        self.generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"batch of {scores.shape[0]} rows for {len(self.generators)} seeds")
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g, dtype=torch.float64) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        logp = torch.log_softmax(scores.double() / self.temperature, dim=-1)
        return (logp + gumbel.to(scores.device)).to(scores.dtype)


class StepCounter(LogitsProcessor):
    """Calls `on_step()` once per decoding step and leaves the scores untouched: progress, never a change."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.on_step()
        return scores
