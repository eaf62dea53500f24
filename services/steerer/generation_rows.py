"""Rows of several groups (steering cells, HTTP requests) through one `generate_rows` call, each distinct row once.

A row is a prompt with its delta (None: unsteered), seed and layer. Two rows with the same prompt text, the same
delta bytes (float32, as the backends add them) or both unsteered, the same seed and the same layer (any layer when
unsteered) generate the same continuation, so it is generated once and handed to both: every cell's alpha = 0 rows
of the same prompts, and the prompted-baseline rows of two cells of one concept. Distinct rows keep their first-seen
order, so a backend's prompt grouping (transformers_backend.prompt_group_chunks) still puts all rows of one prompt in
one chunk, and a lone group's call is exactly its own rows in its own order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence, Sized
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

import numpy as np

from .backend import Generation, GenerationSettings, SteeringBackend

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class GenerationRow:
    """One row of a generate call."""

    prompt: str
    delta: np.ndarray | None
    seed: int
    layer: int

    def identity(self) -> tuple[str, bytes | None, int, int | None]:
        """What the row's continuation depends on: an unsteered row's layer does not matter."""
        if self.delta is None:
            return self.prompt, None, int(self.seed), None
        return self.prompt, np.ascontiguousarray(self.delta, np.float32).tobytes(), int(self.seed), int(self.layer)


def distinct_by(items: Sequence[T], key: Callable[[T], Hashable]) -> tuple[list[T], list[int]]:
    """The items distinct by `key` in first-seen order, and per item the index of its distinct item."""
    seen: dict[Hashable, int] = {}
    distinct: list[T] = []
    index = []
    for item in items:
        at = seen.setdefault(key(item), len(distinct))
        if at == len(distinct):
            distinct.append(item)
        index.append(at)
    return distinct, index


def distinct_rows(rows: Sequence[GenerationRow]) -> tuple[list[GenerationRow], list[int]]:
    """The distinct rows in first-seen order, and per row the index of its distinct row."""
    return distinct_by(rows, GenerationRow.identity)


def group_slices(groups: Sequence[Sized]) -> list[slice]:
    """Each group's slice of the groups laid end to end."""
    ends = list(accumulate(len(group) for group in groups))
    return [slice(end - len(group), end) for group, end in zip(groups, ends, strict=True)]


def call_layers(rows: Sequence[GenerationRow]) -> int | list[int]:
    """`generate_rows`'s layer argument: one int where every steered row steers at one layer (unsteered rows add
    nothing anywhere, so they go with it), else one per row, unsteered rows at the first steered layer."""
    steered = [r.layer for r in rows if r.delta is not None]
    first = steered[0] if steered else (rows[0].layer if rows else 0)
    if all(layer == first for layer in steered):
        return int(first)
    return [int(first if r.delta is None else r.layer) for r in rows]


def generate_groups(backend: SteeringBackend, groups: Sequence[Sequence[GenerationRow]],
                    settings: GenerationSettings, prompt_format: str = "auto",
                    on_token: Callable[[int, int, int], None] | None = None) -> list[list[Generation]]:
    """Each group's generations in row order, from one `generate_rows` call over the distinct rows of all groups
    (no call when there are no rows). `on_token(group, row, token)` sees each row's tokens as they are drawn where
    the backend streams (`streams_tokens`), else all of them when the call returns."""
    flat = [row for group in groups for row in group]
    if not flat:
        return [[] for _ in groups]
    distinct, index = distinct_rows(flat)
    slices = group_slices(groups)
    owners: dict[int, list[tuple[int, int]]] = {}
    for g, part in enumerate(slices):
        for r, at in enumerate(index[part]):
            owners.setdefault(at, []).append((g, r))

    def tap(at: int, token: int) -> None:
        for g, r in owners.get(at, []):
            on_token(g, r, token)  # type: ignore[misc]

    streams = on_token is not None and getattr(backend, "streams_tokens", False)
    extra = {"on_token": tap} if streams else {}
    gens = backend.generate_rows([r.prompt for r in distinct], layer=call_layers(distinct),
                                 deltas=[r.delta for r in distinct], seeds=[r.seed for r in distinct],
                                 settings=settings, prompt_format=prompt_format, **extra)
    if on_token is not None and not streams:
        for at, gen in enumerate(gens):
            for token in gen.token_ids:
                tap(at, token)
    return [[gens[i] for i in index[part]] for part in slices]
