"""The interface both generation backends (transformers, vLLM) implement, and what they return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import SteeringError

# RMSNorm squares the hidden state in fp32 whatever the model's dtype: a delta longer than sqrt(fp32 max) makes it
# infinite and the continuation empty or garbage, so it is refused up front.
NORM_LIMIT_FP32 = float(np.sqrt(np.finfo(np.float32).max))


def delta_norm_limit(dtype_max: float) -> float:
    """The longest delta a model of this dtype carries through its layers and norms without overflow."""
    return min(float(dtype_max), NORM_LIMIT_FP32)


def validate_deltas(deltas: Sequence[np.ndarray | None], hidden_size: int, dtype_max: float) -> None:
    """One line naming the first bad row: a width other than the model's, a non-finite value, or a norm the
    model's dtype cannot carry (alpha = 1e308 would otherwise give 200 and empty text)."""
    limit = delta_norm_limit(dtype_max)
    for i, d in enumerate(deltas):
        if d is None:
            continue
        if np.shape(d) != (hidden_size,):
            raise SteeringError(f"steering delta of row {i} has width {np.shape(d)[-1] if np.ndim(d) else 0} "
                                f"(shape {np.shape(d)}), the model's hidden size is {hidden_size}")
        values = np.asarray(d, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise SteeringError(f"steering delta of row {i} is not finite (alpha or vector too large, or NaN)")
        with np.errstate(over="ignore"):
            norm = float(np.linalg.norm(values))
        if not norm <= limit:
            raise SteeringError(f"steering delta of row {i} has norm {norm:.3g}, over {limit:.3g}, the largest "
                                "the model's dtype carries: lower alpha")


@dataclass(frozen=True)
class GenerationSettings:
    """How continuations are drawn; part of every D2 artefact key."""

    max_new_tokens: int = 32
    temperature: float = 0.7
    greedy: bool = False
    batch_size: int = 256  # rows per generate call (a row is one prompt at one delta)
    # ... and at most this many tokens per call, rows x (longest prompt + max_new_tokens): it bounds the KV
    # cache when a cell's whole alpha grid x prompts shares one batch.
    token_budget: int = 16384
    # How many rows (before shared rows are merged) the driver sends to one engine call, as whole cells: several
    # cells' alpha grids go through one generate, and a killed run loses at most one call's cells. None of
    # these three enters an artefact key.
    max_rows_per_call: int = 4096
    # EOS is suppressed until this many tokens (default: all of them), so every continuation has the same
    # length and perplexities and scores compare like with like.
    min_new_tokens: int | None = None

    @property
    def min_tokens(self) -> int:
        return self.max_new_tokens if self.min_new_tokens is None else min(self.min_new_tokens,
                                                                             self.max_new_tokens)

    def to_record(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_tokens,
                "temperature": self.temperature, "greedy": self.greedy}


@dataclass(frozen=True)
class Generation:
    """One continuation: its text and token ids. `prompt` is the user's text; `prompt_ids` are what the model
    read (chat-formatted for instruct models), so perplexity conditions on exactly that, with no re-tokenising."""

    prompt: str
    text: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


class SteeringBackend(Protocol):
    """Generate continuations of `prompts` with `delta` (None: unsteered) added to the output of `layer`;
    `prompt_format` is auto, chat or plain (prompts.resolve_prompt_format). `generate_rows` takes one delta
    per prompt and one layer or one per prompt, so rows with different vectors, alphas and layers (several
    cells) can share a batch."""

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None,
                 seeds: Sequence[int], settings: GenerationSettings, prompt_format: str = "auto",
                 ) -> list[Generation]: ...

    def generate_rows(self, prompts: Sequence[str], *, layer: int | Sequence[int],
                      deltas: Sequence[np.ndarray | None], seeds: Sequence[int], settings: GenerationSettings,
                      prompt_format: str = "auto") -> list[Generation]: ...


def row_layers(layer: int | Sequence[int], n: int) -> list[int]:
    """`generate_rows`'s layer argument as one layer per row."""
    return [int(layer)] * n if isinstance(layer, int) else [int(x) for x in layer]


def generate_by_delta(backend: SteeringBackend, prompts: Sequence[str], *, layer: int | Sequence[int],
                      deltas: Sequence[np.ndarray | None], seeds: Sequence[int], settings: GenerationSettings,
                      prompt_format: str = "auto") -> list[Generation]:
    """`generate_rows` for a backend that steers one delta at one layer per call: one `generate` per distinct
    (layer, delta), unsteered rows in one call whatever their layer, answers put back in row order."""
    layers = row_layers(layer, len(prompts))
    if not len(prompts) == len(deltas) == len(seeds) == len(layers):
        raise ValueError(f"{len(prompts)} prompts, {len(deltas)} deltas, {len(seeds)} seeds and {len(layers)} "
                         "layers")
    groups: dict[tuple[int, bytes] | None, list[int]] = {}
    for i, (at, d) in enumerate(zip(layers, deltas, strict=True)):
        groups.setdefault(None if d is None else (at, np.asarray(d, np.float32).tobytes()), []).append(i)
    out: list[Generation | None] = [None] * len(prompts)
    for rows in groups.values():
        gens = backend.generate([prompts[i] for i in rows], layer=layers[rows[0]], delta=deltas[rows[0]],
                                seeds=[seeds[i] for i in rows], settings=settings, prompt_format=prompt_format)
        for i, g in zip(rows, gens, strict=True):
            out[i] = g
    return [g for g in out if g is not None]
