"""The mean attention each key receives (S1, S3's `inflow`), in one Triton kernel launched three times: no score
or probability map in memory at all, where the chunked path (attention_inflow) writes and re-reads float32 scores
and probabilities a query chunk at a time (~15 kernels a chunk: 2.7 ms a layer on an H100 at 16 x 512 tokens, 37%
of the raw forward, bench/measured/h100_session30).

Each program owns one (passage, head) and one block of queries or keys, and walks the other axis a tile at a time,
forming each [BLOCK_M, BLOCK_N] score tile from the model-dtype q and k in registers:
  pass 0: each query's largest allowed score m_i;
  pass 1: each query's softmax denominator z_i = Σ_j exp(s_ij - m_i) (the max known before the sum, as
          torch.softmax does: no running rescale, no extra roundings);
  pass 2: per key, Σ_i w_i exp(s_ij - m_i) / z_i over the real queries that see any key, in a fixed order (no
          atomics: the same inputs give the same bits on every run).
The score is the chunked path's: exact products of the half-precision q and k (a bf16 or fp16 value is exact in
tf32, so tensor cores lose nothing; a float32 model multiplies in IEEE float32) summed in float32, times the
scaling; a mask is applied as the chunked path applies it (bool or additive, the causal rule, padding keys), so the
result is today's float32 recomputation up to float32 round-off, within the bound tests/test_inflow_kernel.py
derives. Three passes form each score three times, ~1.5x the FLOPs of the layer's own attention (~1.5% of an 8B
layer's forward at 512 tokens): what is saved is the chunked path's memory traffic and kernel count.

Gemma 2's logit softcap c·tanh(s/c) comes between the scaling and the mask, as in the chunked path; tanh is taken
as (1 - e)/(1 + e) with e = exp(-2|s/c|) (Triton has no portable tanh): a few float32 roundings of a value at most 1,
times c, which the bound's c term covers. Not covered, left to the chunked path: keys not aligned with the queries
(a cache), and devices without Triton. On the CPU the same kernel runs under Triton's interpreter
(TRITON_INTERPRET=1; tests only: slow).
"""

from __future__ import annotations

import logging
import os
from functools import cache

import torch

tl = None  # triton.language once _triton() has run: the kernel's body reads it as a global when it is compiled

logger = logging.getLogger(__name__)

# POOLBENCH_INFLOW_KERNEL: "auto" (the kernel on CUDA where Triton imports), "off" (always the chunked path), "on"
# (on any device: CPU tensors need Triton's interpreter, TRITON_INTERPRET=1; tests)
ENV = "POOLBENCH_INFLOW_KERNEL"
CHOICES = ("auto", "off", "on")
MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2
PASS_MAX, PASS_SUM, PASS_INFLOW = 0, 1, 2
# No fused multiply-adds: the score is rounded after the scaling and again after an additive mask, as the chunked
# path rounds it (mul_, then add_), so the two differ only by their sums' orders.
_LAUNCH = {"enable_fp_fusion": False}


def _inflow_kernel(Q, K, MASK, REAL, ROW_MAX, ROW_SUM, OUT,
                   sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sm_b, sm_h, sm_q, sm_k, sr_b, sr_t,
                   n_heads, group, n_q, n_k, offset, head_dim, scaling, softcap,
                   PASS: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One program: passage b, head h (key head h // group), the outer block of queries (passes 0, 1) or keys
    (pass 2); walks the inner axis in tiles. Row stats are [B·H, n_q] float32; OUT [B·H, n_k] float32."""
    bh = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a [B, 1, T, T] mask passes 2^31 elements at 16 x 12k
    outer = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    kv = h // group
    dims = tl.arange(0, BLOCK_D)
    if PASS == 2:
        cols = outer * BLOCK_N + tl.arange(0, BLOCK_N)
        lo = 0
        if CAUSAL:  # queries before the key block's first key - offset see none of it
            lo = tl.maximum(outer * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
        hi = n_q
        inner_step = BLOCK_M
    else:
        rows = outer * BLOCK_M + tl.arange(0, BLOCK_M)
        lo = 0
        hi = n_k
        if CAUSAL:  # keys after the query block's last query + offset receive nothing from it
            hi = tl.minimum((outer + 1) * BLOCK_M + offset, n_k)
        inner_step = BLOCK_N
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    total = tl.full([BLOCK_N], 0.0, tl.float32)
    shift = tl.full([BLOCK_M], 0.0, tl.float32)
    if PASS == 1:  # the block's rows are fixed: their max, and the shift a row that sees no key takes, once
        row_max = tl.load(ROW_MAX + bh * n_q + rows, mask=rows < n_q, other=float("-inf"))
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    for inner in range(lo, hi, inner_step):
        if PASS == 2:
            rows = inner + tl.arange(0, BLOCK_M)
        else:
            cols = inner + tl.arange(0, BLOCK_N)
        in_q = rows < n_q
        in_k = cols < n_k
        q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :] * sq_d,
                    mask=in_q[:, None] & (dims[None, :] < head_dim), other=0.0).to(tl.float32)
        k = tl.load(K + b * sk_b + kv * sk_h + cols[None, :] * sk_t + dims[:, None] * sk_d,
                    mask=in_k[None, :] & (dims[:, None] < head_dim), other=0.0).to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scaling
        if SOFTCAP:
            capped = scores / softcap
            e = tl.exp(-2.0 * tl.abs(capped))
            scores = tl.where(capped < 0, -1.0, 1.0) * ((1.0 - e) / (1.0 + e)) * softcap
        key_real = tl.load(REAL + b * sr_b + cols * sr_t, mask=in_k, other=0) != 0
        allowed = in_q[:, None] & key_real[None, :]
        if CAUSAL:
            allowed = allowed & (cols[None, :] <= rows[:, None] + offset)
        if MASK_KIND != 0:
            given = tl.load(MASK + b * sm_b + h * sm_h + rows[:, None] * sm_q + cols[None, :] * sm_k,
                            mask=in_q[:, None] & in_k[None, :], other=0)
            if MASK_KIND == 1:
                allowed = allowed & (given != 0)
            else:
                given = given.to(tl.float32)
                allowed = allowed & (given != float("-inf"))
                scores = scores + given
        scores = tl.where(allowed, scores, float("-inf"))
        if PASS == 0:
            row_max = tl.maximum(row_max, tl.max(scores, axis=1))
        elif PASS == 1:
            row_sum += tl.sum(tl.exp(scores - shift[:, None]), axis=1)
        else:
            row_max = tl.load(ROW_MAX + bh * n_q + rows, mask=in_q, other=float("-inf"))
            row_sum = tl.load(ROW_SUM + bh * n_q + rows, mask=in_q, other=0.0)
            real_q = tl.load(REAL + b * sr_b + rows * sr_t, mask=in_q, other=0) != 0
            weight = real_q & (row_max != float("-inf"))  # a real query that sees some key
            shift = tl.where(weight, row_max, 0.0)
            probs = tl.exp(scores - shift[:, None]) / tl.where(weight, row_sum, 1.0)[:, None]
            total += tl.sum(tl.where(weight[:, None], probs, 0.0), axis=0)
    if PASS == 0:
        tl.store(ROW_MAX + bh * n_q + rows, row_max, mask=rows < n_q)
    if PASS == 1:
        tl.store(ROW_SUM + bh * n_q + rows, row_sum, mask=rows < n_q)
    if PASS == 2:
        tl.store(OUT + bh * n_k + cols, total, mask=cols < n_k)


@cache
def _triton():
    """Triton, imported on first use (0.2 s, and of no use to a CPU run); None where it is not installed (it comes
    with CUDA torch and with vLLM's CPU build)."""
    global tl
    try:
        import triton
        import triton.language
    except ImportError:  # pragma: no cover - an install without Triton
        return None
    tl = triton.language
    return triton


def compile_errors() -> tuple[type[Exception], ...]:
    """What a kernel that Triton cannot build on this device raises (for the caller's fallback)."""
    if _triton() is None:
        return ()
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return CompilationError, OutOfResources


@cache
def compiled_kernel():
    """The kernel for the GPU (triton.jit), made once a process; under TRITON_INTERPRET=1 (set before Triton is
    imported: its own library functions are made interpreted then too) it runs on CPU tensors, each program in
    numpy: tests only, slow."""
    triton = _triton()
    if triton is None:
        raise RuntimeError("the attention inflow kernel needs Triton, which is not installed")
    return triton.jit(_inflow_kernel)


def kernel_wanted(device: torch.device) -> bool:
    """Whether the capture computes the mean inflow with the kernel on `device` (ENV's choice, Triton importable,
    no compile failure in this process)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "off" or _FAILED:
        return False
    return (choice == "on" or device.type == "cuda") and _triton() is not None


_FAILED: list[str] = []  # why the kernel was refused: the process keeps to the chunked path after it


def kernel_failed(error: Exception) -> None:
    """Refuse the kernel for the rest of the process, once, with one warning naming why (it did not compile, or
    attention_inflow.kernel_agrees found it computing otherwise): the capture takes the chunked path, the same
    quantity to its own round-off."""
    if not _FAILED:
        _FAILED.append(f"{type(error).__name__}: {error}")
        logger.warning("attention inflow kernel refused (%s); using the chunked path", _FAILED[0])


def block_sizes(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): 64 x 64 score tiles, the head padded to a power of two (zeros add nothing to a
    dot product); 32 x 32 tiles for heads over 128 so a tile's q and k stay in registers."""
    block_d = max(16, 1 << (max(head_dim, 1) - 1).bit_length())
    block = 64 if block_d <= 128 else 32
    return block, block, block_d


def mean_inflow(query: torch.Tensor, key: torch.Tensor, real: torch.Tensor, scaling: float, causal: bool,
                mask: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """Mean inflow [B, H, Tk] float32 over the real queries that see some key (attention_inflow's `mean`), from
    query [B, H, Tq, Dh], key [B, KVH, Tk, Dh] (any strides), real [B, Tq] bool (real queries; key j is real where
    real[:, j]), and `mask` [Bm, Hm, Tq, Tk] with size-1 dims to broadcast (as attention_inflow's _broadcast_mask
    hands it; bool, True attends, or additive float) or None. Keys are aligned to the queries' end (offset Tk - Tq,
    0 without a cache); `softcap` caps the scaled scores."""
    batch, n_heads, n_q, head_dim = query.shape
    n_kv, n_k = key.shape[1], key.shape[2]
    device = query.device
    real = real.to(device=device, dtype=torch.bool)
    real_bytes = _bytes(real)
    kind, given = MASK_NONE, real_bytes  # an unused pointer where no mask is given
    if mask is not None:
        given = mask.expand(batch, n_heads, n_q, n_k)
        kind = MASK_BOOL if given.dtype == torch.bool else MASK_ADDITIVE
        if kind == MASK_BOOL:
            given = _bytes(given)
    mask_strides = given.stride() if kind != MASK_NONE else (0, 0, 0, 0)
    row_max = torch.empty(batch * n_heads, n_q, dtype=torch.float32, device=device)
    row_sum = torch.empty_like(row_max)
    out = torch.empty(batch * n_heads, n_k, dtype=torch.float32, device=device)
    block_m, block_n, block_d = block_sizes(head_dim)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    kernel = compiled_kernel()
    common = (query, key, given, real_bytes, row_max, row_sum, out, *query.stride(), *key.stride(), *mask_strides,
              *real_bytes.stride(), n_heads, n_heads // n_kv, n_q, n_k, n_k - n_q, head_dim, float(scaling),
              float(softcap or 1.0))
    for step, blocks in ((PASS_MAX, block_m), (PASS_SUM, block_m), (PASS_INFLOW, block_n)):
        length = n_k if step == PASS_INFLOW else n_q
        grid = (batch * n_heads, -(-length // blocks))
        kernel[grid](*common, PASS=step, CAUSAL=causal, MASK_KIND=kind, SOFTCAP=bool(softcap), PRECISION=precision,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, **_LAUNCH)
    n_real = real.sum(dim=1).clamp(min=1).to(torch.float32)
    return out.view(batch, n_heads, n_k) / n_real[:, None, None]


def _bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8 for the kernel's loads: a view where its strides allow, else a copy."""
    return flags.view(torch.uint8) if flags.is_contiguous() else flags.to(torch.uint8)
