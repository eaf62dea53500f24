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

from poolbench.extractor.attention_inflow import CHUNK_BUDGET_BYTES, recompute_bytes_per_token

DEFAULT_MAX_BATCH_TOKENS = 8192  # batch 32 x 256 tokens, today's largest batch: the budget only ever lowers it
# On a CPU a forward is fastest at about a thousand padded tokens: beyond that its activations (and S2's saved
# graph) leave the caches for main memory, and each forward's new large tensors fault in fresh pages. Measured on
# SmolLM2-135M, 2-core Zen 4 (32 MiB L3), one concept's pooling with every strategy (bench/README.md, "Rows per
# forward on a CPU"): 35.2 s at this budget's buckets against 46-48 s at 32 rows of ~150 tokens.
CPU_MAX_BATCH_TOKENS = 1024
MEMORY_FRACTION = 0.25  # of the free memory one forward may use by default, leaving room for the rest
FLOAT32_BYTES = 4
EXTRA_BYTES_FLOOR = 512 * 2**20  # attention maps may always take this much in one forward
HEAD_CHUNK_BYTES = 2**30  # what one chunk of S2's LM head may hold at once (logits and their float32 work)
HEAD_BYTES_PER_LOGIT = 16  # model-dtype logits, a float32 copy, exp/softmax and the logits' gradient, rounded up
GRADIENT_MEMORY_FRACTION = 0.8  # of the free memory S2's forward + backward may use (the rest: allocator slack)


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
    attention_per_key: int  # what grows with rows x length^2 (0 since S1/S3's inflow is recomputed in query chunks)
    gradient: int = 0  # S2's saved backward graph from the shallowest requested layer up (model-dtype activations)
    gradient_per_key: int = 0  # what that graph keeps per key position (eager attention's probabilities)
    head_chunk: int = 0  # the chunked LM head's one chunk of logits and their work, once per S2 forward
    attention_per_token: int = 0  # S1/S3's inflow accumulators and key copy (attention_inflow), per padded token
    attention_reserve: int = 0  # one query chunk's temporaries (at most CHUNK_BUDGET_BYTES), once per forward


def chunk_tokens_for(vocab_size: int, chunk_bytes: int | None = None) -> int:
    """Tokens one LM-head chunk may take so its logits and their work stay within chunk_bytes (HEAD_CHUNK_BYTES)."""
    limit = HEAD_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(1, limit // max(1, vocab_size * HEAD_BYTES_PER_LOGIT))


def graph_bytes_per_block(*, hidden_size: int, intermediate_size: int, kv_size: int, itemsize: int) -> int:
    """What autograd keeps per token for one Llama-style block when only the activations need gradients (the
    weights are frozen, so no linear keeps its input): the MLP's gate, up and their product (3 x MLP width),
    q/k/v/rope/attention output (about 3 x hidden + 2 x key-value width) in the model's dtype, and the two
    RMSNorms' float32 inputs. Against autograd's saved tensors on random 4-layer Llamas (tests/test_s2_memory.py) the
    graph it gives is 1.32-1.37x (one of its 4 blocks stands for the final norm); on an H100 (8B shape) the S2
    peak it models was 1.15x the one measured (bench/measured/s2_memory)."""
    return itemsize * (3 * intermediate_size + 3 * hidden_size + 2 * kv_size) + FLOAT32_BYTES * 2 * hidden_size


def token_costs(*, hidden_size: int, intermediate_size: int, n_heads: int, vocab_size: int, n_layers: int,
                layers: Sequence[int], itemsize: int, out_itemsize: int, needs: Collection[str] = frozenset(),
                kv_size: int | None = None, eager_attention: bool = False, n_kv_heads: int | None = None,
                head_dim: int | None = None) -> TokenCosts:
    """Per-token bytes from the model's shape: activations in the model's dtype, attention maps in float32; S2's
    graph from the shallowest requested layer up (n_layers - min(layers) blocks: the blocks after it and one for
    the final norm; every block when the leaf is the embeddings, layers=(0,)) and the LM head's one chunk."""
    captured = 2 * len(layers) * hidden_size * out_itemsize
    block = itemsize * (8 * hidden_size + 4 * intermediate_size)
    attention: dict[str, int] = {}
    if "attention" in needs:  # query-chunked recomputation: a per-token term and one bounded chunk, no T x T map
        dim = head_dim or hidden_size // max(n_heads, 1)
        attention = {"attention_per_token": recompute_bytes_per_token(n_heads, n_kv_heads or n_heads, dim),
                     "attention_reserve": CHUNK_BUDGET_BYTES}
    if "gradient" not in needs:
        return TokenCosts(plain=captured + block, attention_per_key=0, **attention)
    blocks = n_layers - min(layers)
    per_block = graph_bytes_per_block(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                      kv_size=hidden_size if kv_size is None else kv_size, itemsize=itemsize)
    cast = itemsize if itemsize < FLOAT32_BYTES else 0  # eager softmax in float32, then a copy in the model's dtype
    per_key = blocks * n_heads * (FLOAT32_BYTES + cast) if eager_attention else 0
    head = chunk_tokens_for(vocab_size) * vocab_size * HEAD_BYTES_PER_LOGIT if vocab_size else 0
    return TokenCosts(plain=captured + block, attention_per_key=0, **attention, gradient=blocks * per_block,
                      gradient_per_key=per_key, head_chunk=head)


def rows_per_forward(costs: TokenCosts, max_batch_tokens: int, length: int) -> int:
    """Rows of padded length `length` one chunk may take: at most max_batch_tokens padded tokens, and fewer when
    a term growing with length^2 adds more than max_batch_tokens plain tokens' worth of bytes (never less than
    EXTRA_BYTES_FLOOR). S1/S3's chunked recomputation adds a per-token term (~1% of `plain` on Llama-8B: 4.6 KB
    against 377 KB) and one bounded chunk, both taken from the memory the budget's fraction leaves free, so it
    cuts no rows. S2 never cuts a chunk: it runs its forward and backward in sub-chunks of
    gradient_rows_per_forward rows inside it, so the other strategies pool the chunk whole."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    length = max(length, 1)
    rows = max_batch_tokens // length
    extra = costs.attention_per_key * length
    if extra:
        allowed = max(max_batch_tokens * costs.plain, EXTRA_BYTES_FLOOR)
        rows = min(rows, allowed // ((costs.plain + extra) * length))
    return max(1, rows)


def gradient_rows_per_forward(costs: TokenCosts, max_batch_tokens: int, length: int, free_bytes: int, *,
                              fraction: float = GRADIENT_MEMORY_FRACTION) -> int:
    """Rows of one S2 forward + backward inside a chunk of rows_per_forward rows: what a fraction of the free
    memory holds once the chunk's own plain bytes and the LM head's chunk are set aside, at most the chunk."""
    chunk = rows_per_forward(costs, max_batch_tokens, length)
    length = max(length, 1)
    per_row = length * (costs.plain + costs.attention_per_token + (costs.attention_per_key + costs.gradient_per_key)
                        * length + costs.gradient)
    room = int(free_bytes * fraction) - costs.head_chunk - costs.attention_reserve - chunk * length * costs.plain
    return max(1, min(chunk, room // per_row))


def default_max_batch_tokens(free_bytes: int, plain_bytes_per_token: int, *,
                             fraction: float = MEMORY_FRACTION, cap: int = DEFAULT_MAX_BATCH_TOKENS) -> int:
    """The budget a run gets unless it names one: a fraction of free memory, at most `cap` (today's largest
    batch on an accelerator, budget_cap's CPU_MAX_BATCH_TOKENS on a CPU)."""
    fits = int(free_bytes * fraction) // max(plain_bytes_per_token, 1)
    return max(1, min(cap, fits))


def budget_cap(device: object = "cpu") -> int:
    """The most padded tokens a default budget gives one forward on this device: the CPU's cache-sized forward,
    an accelerator's largest batch (its memory, not its caches, bounds it there)."""
    import torch

    return CPU_MAX_BATCH_TOKENS if torch.device(device).type == "cpu" else DEFAULT_MAX_BATCH_TOKENS  # type: ignore[arg-type]


def free_memory_bytes(device: object = "cpu") -> int:
    """Memory a new allocation can use now: the GPU's free memory (with torch's cached, unused blocks), else the
    host's available memory (within the process's cgroup limit when there is one)."""
    import torch

    device = torch.device(device)  # type: ignore[arg-type]
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))  # blocks torch's allocator holds but no tensor uses are free too
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
