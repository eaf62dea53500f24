"""A row-wise log-sum-exp over a vocabulary's logits on a CPU, in blocks of rows through one reused buffer.

Why: `torch.logsumexp(x, dim=-1)` allocates `x - max` as a temporary the size of `x` and passes over it three
times. For the fluency guard's reference pass (1,024 tokens x Gemma-3's 262,144 words, 1 GiB of float32 a chunk)
and S2's LM-head chunks (~1,000 tokens x SmolLM2's 49,152 words) that temporary is fresh memory every chunk: the
page faults of its first touch and passes over main memory cost about as much as the arithmetic (0.57-0.69 s
against 0.21-0.34 s for a 1,024 x 262,144 chunk on this 2-core CPU, bench/README.md). Here the same operations
(torch's own: amax, subtract, exp in place, sum, log, add the max back) run on blocks of rows whose temporary is
one small buffer, reused while it is still in cache.

Equal to torch.logsumexp: every row is reduced alone in both (a CPU reduction over the last dimension of two or
more rows splits the rows among threads, never a row), so the sums are the same bits as long as their terms are;
the element-wise exp is the same vectorised kernel wherever each thread's share of the elements is a whole number
of SIMD vectors: a vocabulary that is a multiple of 64 (every model the project names; a step is 32 floats with
AVX-512) on 1, 2, 4 ... threads (tests/test_logsumexp_rows.py checks bit equality there). Otherwise the few
elements at the end of a thread's share take the scalar exp instead of the vectorised one, both within an ulp, in
either function: the two results then differ by a few ulps at most.
A GPU keeps torch.logsumexp: its caching allocator reuses memory and blocks would only add launches.
"""

from __future__ import annotations

import math

import torch

BLOCK_ROWS = 64  # rows a block: its buffer is 64 x V floats (64 MiB at 262,144 words, 12 MiB at 49,152)


def logsumexp_rows(logits: torch.Tensor, *, block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """log(sum(exp(logits), dim=-1)) of a 2-D float32/float64 CPU tensor, as torch.logsumexp computes it (the
    module docstring says how exactly); anything else goes to torch.logsumexp itself."""
    if (logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float64)
            or logits.shape[0] <= block_rows or not logits.is_contiguous()):
        return torch.logsumexp(logits, dim=-1)
    n, width = logits.shape
    out = torch.empty(n, dtype=logits.dtype)
    maxes = torch.empty(n, dtype=logits.dtype)
    buffer = torch.empty((block_rows + 1, width), dtype=logits.dtype)
    # a last block of one row would be reduced by every thread together, not as a row alone: it joins the one before
    starts = list(range(0, n, block_rows))
    if n - starts[-1] < 2:
        starts.pop()
    for start, stop in zip(starts, [*starts[1:], n], strict=True):
        block = logits[start:stop]
        block_max = torch.amax(block, dim=-1, keepdim=True)
        block_max.masked_fill_(block_max.abs() == math.inf, 0)  # torch's order: an all -inf row sums exp(-inf) = 0
        shifted = torch.sub(block, block_max, out=buffer[:stop - start])
        torch.sum(shifted.exp_(), dim=-1, out=out[start:stop])
        maxes[start:stop] = block_max.squeeze(-1)
    return out.log_().add_(maxes)
