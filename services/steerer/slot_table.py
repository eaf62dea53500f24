"""Per-request steering in one flattened batch, multi-LoRA style: a [slots, d] table of deltas on the device and a
per-token slot index, so every token adds its own request's delta and nothing else.

Slot 0 is the zero row (unsteered requests, and padding tokens beyond the step's real ones); rows with the same
delta share a slot. Pure torch/numpy: the vLLM backend calls it inside the engine's worker, the tests on CPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch


def build_slot_table(deltas: Sequence[np.ndarray | None], hidden_size: int) -> tuple[np.ndarray, list[int]]:
    """([slots, d] float32 table with the zero row first, each row's slot); equal deltas share one slot."""
    rows = [np.zeros(hidden_size, np.float32)]
    seen: dict[bytes, int] = {}
    slots = []
    for d in deltas:
        if d is None:
            slots.append(0)
            continue
        values = np.ascontiguousarray(d, dtype=np.float32)
        key = values.tobytes()
        if key not in seen:
            seen[key] = len(rows)
            rows.append(values)
        slots.append(seen[key])
    return np.stack(rows), slots


def build_layer_tables(layers: Sequence[int], deltas: Sequence[np.ndarray | None], hidden_size: int,
                       ) -> tuple[dict[int, np.ndarray], list[int]]:
    """Rows steering at different layers in one call: a slot per distinct (layer, delta), and per layer a table
    whose rows are zero except that layer's slots; layers no row steers at get no table."""
    keyed = [None if d is None else np.concatenate([[float(layer)], np.asarray(d, np.float32)])
             for layer, d in zip(layers, deltas, strict=True)]
    table, slots = build_slot_table(keyed, hidden_size + 1)
    tables = {}
    for layer in sorted({int(t[0]) for t in table[1:]}):
        rows = table[:, 1:].copy()
        rows[table[:, 0] != layer] = 0
        rows[0] = 0
        tables[layer] = rows
    return tables, slots


def token_slots(request_slots: Sequence[int], tokens_per_request: Sequence[int]) -> np.ndarray:
    """The slot of every token of a flattened step: request i's slot repeated for its scheduled tokens."""
    return np.repeat(np.asarray(request_slots, np.int64), np.asarray(tokens_per_request, np.int64))


def write_token_slots(index: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
    """Fill the device index in place (a buffer a captured graph may read): real tokens first, the rest slot 0.
    Grows (a new buffer) only when the step has more tokens than it holds."""
    n = len(slots)
    if n > index.numel():
        index = torch.zeros(n, dtype=index.dtype, device=index.device)
    index[n:].zero_()
    index[:n].copy_(torch.from_numpy(np.asarray(slots, np.int64)).to(index.dtype), non_blocking=True)
    return index


def add_slot_vectors(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden [tokens, d] (or [..., tokens, d] flattened by the engine) plus each token's table row."""
    n = hidden.shape[-2]
    return hidden + table[index[:n]].to(hidden.dtype)


def slot_batches(layers: Sequence[int], deltas: Sequence[np.ndarray | None], capacity: int) -> list[list[int]]:
    """Rows split, in order, into as few groups as keep each group's distinct (layer, delta) slots within
    `capacity` (a compiled engine's tables have a fixed number of rows); one group when they all fit."""
    groups: list[list[int]] = [[]]
    seen: set[bytes] = set()
    for i, (layer, d) in enumerate(zip(layers, deltas, strict=True)):
        key = None if d is None else np.float32(layer).tobytes() + np.ascontiguousarray(d, np.float32).tobytes()
        if key is not None and key not in seen and len(seen) >= capacity:
            groups.append([])
            seen = set()
        if key is not None:
            seen.add(key)
        groups[-1].append(i)
    return [g for g in groups if g]


def delta_salt(layer: int, delta: np.ndarray | None) -> str | None:
    """A request's prefix-cache salt (vLLM's `cache_salt`): KV computed under one (layer, delta) is reused only by
    requests steered the same way; unsteered requests share theirs (None)."""
    if delta is None:
        return None
    data = np.float32(layer).tobytes() + np.ascontiguousarray(delta, np.float32).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()
