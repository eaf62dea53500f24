"""Length-bucketed batch plans, and the token budget that bounds what one forward may hold in memory.

A plan cuts passages into length buckets (today's batches); the budget then cuts each bucket into row chunks
of the same padded length, so a small budget changes how many forwards run, never what a passage's hidden
states are. Costs are bytes per padded token, estimated from the model's shape.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BATCH_TOKENS = 8192  # batch 32 x 256 tokens, today's largest batch: the budget only ever lowers it
MEMORY_FRACTION = 0.25  # of the free memory one forward may use by default, leaving room for the rest
FLOAT32_BYTES = 4
EXTRA_BYTES_FLOOR = 512 * 2**20  # attention maps and S2's graph may always take this much in one forward


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


def row_chunks(n_rows: int, rows_per_chunk: int) -> list[slice]:
    """Consecutive row slices of at most rows_per_chunk rows (at least one), covering every row once."""
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
    return [slice(start, min(start + rows_per_chunk, n_rows)) for start in range(0, n_rows, rows_per_chunk)]


@dataclass(frozen=True)
class TokenCosts:
    """Bytes one padded token costs in a forward: the plain hooked forward, and what attention and S2 add."""

    plain: int  # the captured hidden states (kept while the pooler reads the previous chunk) + one block's work
    attention_per_key: int  # recomputed probabilities and their temporaries, per key position of the row
    gradient: int  # the saved backward graph from the shallowest requested layer up, and the LM head's logits


def token_costs(*, hidden_size: int, intermediate_size: int, n_heads: int, vocab_size: int, n_layers: int,
                layers: Sequence[int], itemsize: int, out_itemsize: int,
                needs: Collection[str] = frozenset()) -> TokenCosts:
    """Per-token bytes from the model's shape: activations in the model's dtype, attention maps and logits in
    float32; the constants count the tensors each step keeps alive at once (measured on SmolLM2 and the tiny
    Llama, rounded up)."""
    captured = 2 * len(layers) * hidden_size * out_itemsize
    block = itemsize * (8 * hidden_size + 4 * intermediate_size)
    attention = 4 * n_heads * FLOAT32_BYTES if "attention" in needs else 0
    gradient = 0
    if "gradient" in needs:
        graph_layers = n_layers - min(layers)
        gradient = graph_layers * itemsize * (12 * hidden_size + 5 * intermediate_size) + 4 * vocab_size * FLOAT32_BYTES
    return TokenCosts(plain=captured + block, attention_per_key=attention, gradient=gradient)


def rows_per_forward(costs: TokenCosts, max_batch_tokens: int, length: int) -> int:
    """Rows of padded length `length` one forward may take: at most max_batch_tokens padded tokens, and fewer
    when attention and S2 add more per token than max_batch_tokens plain tokens' worth of bytes (never less
    than EXTRA_BYTES_FLOOR: smaller chunks would save nothing that matters and only cost speed)."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    length = max(length, 1)
    rows = max_batch_tokens // length
    extra = costs.attention_per_key * length + costs.gradient
    if extra:
        allowed = max(max_batch_tokens * costs.plain, EXTRA_BYTES_FLOOR)
        rows = min(rows, allowed // ((costs.plain + extra) * length))
    return max(1, rows)


def default_max_batch_tokens(free_bytes: int, plain_bytes_per_token: int, *,
                             fraction: float = MEMORY_FRACTION, cap: int = DEFAULT_MAX_BATCH_TOKENS) -> int:
    """The budget a run gets unless it names one: a fraction of free memory, at most today's largest batch."""
    fits = int(free_bytes * fraction) // max(plain_bytes_per_token, 1)
    return max(1, min(cap, fits))


def free_memory_bytes(device: object = "cpu") -> int:
    """Memory a new allocation can use now: the GPU's free memory, else the host's available memory (within
    the process's cgroup limit when there is one)."""
    import torch

    device = torch.device(device)  # type: ignore[arg-type]
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    available = _meminfo_available()
    limit = _cgroup_headroom()
    candidates = [value for value in (available, limit) if value is not None]
    if candidates:
        return min(candidates)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """cgroup v2 memory.max minus memory.current, when a limit is set."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None
