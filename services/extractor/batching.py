"""Length-bucketed batch plans: passages of similar length share a batch so little compute goes to padding."""

from __future__ import annotations

from collections.abc import Sequence


def plan_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Cut indices, longest first (ties by index), into batches of <= batch_size passages and <= max_tokens
    padded tokens (batch size x longest length); deterministic, every index exactly once.

    Longest first so a batch that does not fit in memory fails at once. A passage longer than max_tokens
    on its own still gets a batch of one: it cannot be split.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    if any(length < 0 for length in lengths):
        raise ValueError("token lengths must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        if current:
            padded = lengths[current[0]] * (len(current) + 1)
            if len(current) == batch_size or (max_tokens is not None and padded > max_tokens):
                batches.append(current)
                current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches
