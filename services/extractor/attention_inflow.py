"""Attention each key receives (S1, S3), from one layer's queries, keys and mask, a chunk of queries at a time.

On CUDA the mean over queries comes from a Triton kernel instead (inflow_kernel: no map in memory at all, the same
float32 quantity to round-off); this chunked path is its fallback and the CPU's.

Only [B, H, chunk, T] of the probability map exists at once, the chunk chosen so its temporaries stay within
CHUNK_BUDGET_BYTES; grouped-query heads share their key head through a reshape of the queries (K is never
repeated). Scores are the exact products of the model-dtype q and k summed in float32 (a float32-output product
on CUDA, float32 copies elsewhere), and the softmax's max and sum are float32: the result is today's float32
recomputation up to float32 round-off. Rounding the scores to bf16 instead would move each probability by up to
|score|·2^-8 of itself, a change of S1/S3's stored vectors, so it is not done.

In a causal layer a chunk's scores stop at its last query's own key: the keys after it receive nothing from the
chunk, whatever the mask, so about half of a layer's score work is never done. That holds for a mask that is
causal (sdpa's padded bool mask, an additive one, a sliding window); `later_keys_allowed` tells on the device
whether a mask lets a real query see a later key, and the capture stops with an error where one did (a model whose
"causal" layers attend forward cannot be trimmed, and would otherwise lose that share silently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import inflow_kernel

FLOAT32_BYTES = 4
CHUNK_BUDGET_BYTES = 256 * 2**20  # one query chunk's temporaries on a GPU, whatever the batch: few, large kernels
# Off GPUs a chunk that stays near the caches is faster (bench/attention_recompute.py: 8B heads, 4 x 512 tokens,
# one core: 0.8 s at 32 MiB against 1.5 s at 256 MiB), so the host takes the smaller of the two.
HOST_CHUNK_BUDGET_BYTES = 32 * 2**20
# Bytes per score of one chunk alive at once: float32 scores and the probabilities softmax writes beside them
# (4 + 4), two boolean masks (1 + 1) and, for a float mask given per head, its masked copy (4).
CHUNK_BYTES_PER_SCORE = 14
_FLOAT32_OUT_PRODUCT: dict[str, bool] = {}  # device type -> bmm(..., out_dtype=float32) ran there


@dataclass(frozen=True)
class ScoreRule:
    """How a layer turns q·k into logits: scaling, Gemma 2's softcap, and the mask it was given."""

    scaling: float
    softcap: float | None
    causal: bool  # used only where no 4-D mask is given (flash's padding-only masks, sdpa's is_causal)
    mask: torch.Tensor | None  # [Bm, Hm, Tq, >=Tk]: bool (True attends) or additive float; None: causal alone


@dataclass(frozen=True)
class Inflow:
    """Per head, what each key receives: the mean over real queries and the last real query's row."""

    mean: torch.Tensor  # [B, H, Tk] float32
    last: torch.Tensor  # [B, H, Tk] float32


def chunk_budget(device: torch.device | str) -> int:
    """Bytes one query chunk's temporaries may take on `device`."""
    budget = CHUNK_BUDGET_BYTES
    return budget if torch.device(device).type == "cuda" else min(budget, HOST_CHUNK_BUDGET_BYTES)


def query_chunk(rows: int, n_heads: int, n_queries: int, n_keys: int, budget: int | None = None) -> int:
    """Queries per chunk so the chunk's temporaries fit `budget` (CHUNK_BUDGET_BYTES unless named; at least one
    query)."""
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    per_query = CHUNK_BYTES_PER_SCORE * max(rows, 1) * n_heads * max(n_keys, 1)
    return max(1, min(max(n_queries, 1), budget // per_query))


def recompute_bytes_per_token(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes per padded token that grow with rows × length: float32 inflow and last-row accumulators and
    probabilities, the float32 copy of the keys (off CUDA) and the boolean masks' per-key share."""
    return FLOAT32_BYTES * (4 * n_heads + n_kv_heads * head_dim) + 4


def recompute_bytes_per_row(n_heads: int, n_kv_heads: int, head_dim: int, length: int, chunk: int) -> int:
    """Peak bytes one batch row of padded `length` adds while a layer's inflow is recomputed at query chunk
    `chunk`: the chunk's temporaries (H × chunk × length) plus the per-token terms (no length² term)."""
    temporaries = CHUNK_BYTES_PER_SCORE * n_heads * min(chunk, length) * length
    queries = FLOAT32_BYTES * n_heads * min(chunk, length) * head_dim
    return temporaries + queries + length * recompute_bytes_per_token(n_heads, n_kv_heads, head_dim)


def attention_inflow(query: torch.Tensor, key: torch.Tensor, query_mask: torch.Tensor, last_index: torch.Tensor,
                     rule: ScoreRule, chunk: int | None = None) -> Inflow:
    """Inflow from query [B, H, Tq, Dh] and key [B, KVH, Tk, Dh] (model dtype); query_mask [B, Tq] bool marks
    real tokens (padding keys receive nothing, padding queries add nothing), last_index [B] the last real one."""
    batch, n_heads, n_q, head_dim = query.shape
    n_kv, n_k = key.shape[1], key.shape[2]
    group = n_heads // n_kv
    q = query.unflatten(1, (n_kv, group))  # [B, KVH, G, Tq, Dh], a view
    keys_t = key.transpose(-1, -2).reshape(batch * n_kv, head_dim, n_k)
    float32_out = _float32_out_product(query)
    if not float32_out:
        keys_t = keys_t.float()
    real = query_mask.to(device=query.device, dtype=torch.bool)
    key_ok = real[:, :n_k]
    mask = None if rule.mask is None else _broadcast_mask(rule.mask, n_q, n_k)
    last = _last_row(q, keys_t, last_index, n_k - n_q, mask, key_ok, rule, float32_out)
    if chunk is None and _kernel_serves(query, n_k) and kernel_agrees(
            query.device, query.dtype, rule.softcap, head_dim=head_dim, masks=(None if mask is None else mask.dtype,)):
        return Inflow(mean=inflow_kernel.mean_inflow(query, key, real, rule.scaling, rule.causal, mask, rule.softcap),
                      last=last)
    return Inflow(mean=_chunked_mean(q, keys_t, real, key_ok, mask, rule, float32_out, chunk), last=last)


def _kernel_serves(query: torch.Tensor, n_k: int) -> bool:
    """Whether the Triton kernel (inflow_kernel) computes this layer's mean inflow: on CUDA with Triton, keys
    aligned with the queries (no cache)."""
    return n_k == query.shape[2] and inflow_kernel.kernel_wanted(query.device)


_KERNEL_AGREES: dict[tuple, bool] = {}
BOTH_MASKS: tuple[torch.dtype | None, ...] = (None, torch.bool)


def kernel_agrees(device: torch.device, dtype: torch.dtype, softcap: float | None = None, *, head_dim: int = 64,
                  masks: tuple[torch.dtype | None, ...] = BOTH_MASKS) -> bool:
    """Once a process for each device, dtype, softcap, head size and mask form, before the kernel computes a record
    there: the kernel and this chunked path on a seeded case (two tiles each way, grouped heads, left padding, each
    of `masks`: none, sdpa's bool mask, or an additive one of that dtype; the softcap), within the round-off both
    paths share, |Δ| <= 4·eps32·(1 + 2(S + c))·√(Dh + Tk + Tq) with S the largest scaling·Σ|q_i k_i| and c the
    softcap (tests/test_attention_inflow.py derives it). A kernel that does not compile, or compiles and computes
    otherwise on some GPU or Triton, gives one warning and the chunked path for the rest of the process: never a
    silently different S1/S3. A few milliseconds and one wait for the device, once. The capture asks with its
    layer's head size and mask form, so the kernels Triton builds for the check are the ones the records launch
    (on a machine without Triton's cache, each build is a second or more of the first forward)."""
    key = (str(device), dtype, softcap or None, head_dim, masks)
    if key not in _KERNEL_AGREES:
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(2, 4, 80, head_dim, generator=generator).to(dtype)
        keys = torch.randn(2, 2, 80, head_dim, generator=generator).to(dtype)
        real = torch.ones(2, 80, dtype=torch.bool)
        real[0, :30] = False
        causal = (torch.ones(80, 80, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
        products = query.double().abs() @ keys.double().abs().repeat_interleave(2, dim=1).transpose(-1, -2)
        scale = 1 + 2 * (0.125 * float(products.max()) + (softcap or 0.0))
        bound = 4 * torch.finfo(torch.float32).eps * scale * (head_dim + 80 + 80) ** 0.5
        q, k, r = query.to(device), keys.to(device), real.to(device)
        try:
            worst = 0.0
            for form in masks:
                mask = _check_mask(causal, form, device)
                by_kernel = inflow_kernel.mean_inflow(q, k, r, 0.125, True, mask, softcap)
                by_chunks = attention_inflow(q, k, r, last_real_index(r), ScoreRule(0.125, softcap, True, mask),
                                             chunk=16).mean
                worst = max(worst, float((by_kernel - by_chunks).abs().max()))
            agrees = worst <= bound  # False for a NaN too
            if not agrees:
                inflow_kernel.kernel_failed(ValueError(f"it differs from the chunked path by {worst:.3g} on {device} "
                                                       f"in {dtype}, over the round-off bound {bound:.3g}"))
        except inflow_kernel.compile_errors() as error:
            inflow_kernel.kernel_failed(error)
            agrees = False
        _KERNEL_AGREES[key] = agrees
    return _KERNEL_AGREES[key]


def _check_mask(causal: torch.Tensor, form: torch.dtype | None, device: torch.device) -> torch.Tensor | None:
    """The check's mask in one form, on `device`: none, the bool mask (True attends), or additive (0 where it
    attends, the dtype's lowest elsewhere, as transformers builds it)."""
    if form is None:
        return None
    if form == torch.bool:
        return causal.to(device)
    return torch.zeros(causal.shape, dtype=form).masked_fill(~causal, torch.finfo(form).min).to(device)


def last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last real token, for left or right padding."""
    length = mask.shape[1]
    return length - 1 - torch.argmax(mask.flip(1).to(torch.int8), dim=1)


def _chunked_mean(q: torch.Tensor, keys_t: torch.Tensor, real: torch.Tensor, key_ok: torch.Tensor,
                  mask: torch.Tensor | None, rule: ScoreRule, float32_out: bool, chunk: int | None) -> torch.Tensor:
    """The mean inflow [B, H, Tk] a query chunk at a time (float32 scores and probabilities of one chunk)."""
    batch, n_kv, group, n_q, _ = q.shape
    n_heads, n_k = n_kv * group, keys_t.shape[-1]
    chunk = chunk or query_chunk(batch, n_heads, n_q, n_k, chunk_budget(q.device))
    total = torch.zeros(batch * n_heads, 1, n_k, dtype=torch.float32, device=q.device)
    offset = n_k - n_q
    for start in range(0, n_q, chunk):
        stop = min(start + chunk, n_q)
        # Causal: keys past the chunk's last query + offset receive nothing, so are not computed (a given mask is
        # causal too, which the capture checks with later_keys_allowed).
        n_used = min(n_k, stop + offset) if rule.causal else n_k
        positions = torch.arange(start, stop, device=q.device)[None]
        scores = _scores(q[:, :, :, start:stop], keys_t[:, :, :n_used], rule, float32_out)
        rows = None if mask is None else mask[:, :, start:stop, :n_used]
        probs, alive = _probabilities(scores, positions, offset, rows, key_ok[:, :n_used], rule)
        weights = (real[:, None, start:stop] & alive[..., 0]).to(torch.float32)  # [B, H or 1, c]
        weights = weights.expand(batch, n_heads, stop - start).reshape(batch * n_heads, 1, stop - start)
        total[:, :, :n_used].baddbmm_(weights, probs.view(batch * n_heads, stop - start, n_used))
        del scores, probs  # before the next chunk's scores exist
    n_real = real.sum(dim=1).clamp(min=1).to(torch.float32)
    return total.view(batch, n_heads, n_k) / n_real[:, None, None]


def later_keys_allowed(mask: torch.Tensor, query_mask: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """A 0-dim bool tensor on the mask's device: whether `mask` (bool, True attends, or additive float) lets a real
    query (query_mask [B, Tq]) attend a key after its own position (keys aligned to the queries' end, as a cache
    would put them). An additive mask blocks with -inf or its dtype's lowest value (transformers' eager masks): a
    score plus that is far below exp's underflow, so such a key's probability is exactly 0 untrimmed too. No host
    sync: the caller reads it once the forward is done."""
    full = _broadcast_mask(mask, n_q, n_k)
    allowed = full if full.dtype == torch.bool else full > torch.finfo(full.dtype).min / 2
    offset = n_k - n_q
    later = torch.arange(n_k, device=mask.device) > torch.arange(n_q, device=mask.device)[:, None] + offset
    real = query_mask.to(device=mask.device, dtype=torch.bool)[:, :n_q]
    return (allowed & later & real[:, None, :, None]).any()


def _broadcast_mask(mask: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """The mask as a [Bm, Hm, Tq, Tk] view (size-1 dims broadcast, as adding it to the scores would)."""
    mask = mask[..., :n_k]
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(mask.shape[0], mask.shape[1], n_q, n_k)


def _last_row(q: torch.Tensor, keys_t: torch.Tensor, last_index: torch.Tensor, offset: int,
              mask: torch.Tensor | None, key_ok: torch.Tensor, rule: ScoreRule, float32_out: bool) -> torch.Tensor:
    """The last real query's probabilities [B, H, Tk], one row per passage, computed on their own."""
    batch, n_kv, group = q.shape[:3]
    rows_index = torch.arange(batch, device=q.device)
    last = last_index.to(q.device)
    q_last = q[rows_index, :, :, last].unsqueeze(3)  # [B, KVH, G, 1, Dh]
    rows = None
    if mask is not None:
        full = mask.expand(batch, *mask.shape[1:])
        rows = full[rows_index, :, last].unsqueeze(2)  # [B, Hm, 1, Tk]
    scores = _scores(q_last, keys_t, rule, float32_out)
    probs, alive = _probabilities(scores, last[:, None], offset, rows, key_ok, rule)
    return (probs * alive).view(batch, n_kv * group, -1)


def _scores(q: torch.Tensor, keys_t: torch.Tensor, rule: ScoreRule, float32_out: bool) -> torch.Tensor:
    """Logits [B, H, c, Tk] in float32 for q [B, KVH, G, c, Dh] against keys_t [B·KVH, Dh, Tk], scaled and
    softcapped. Off CUDA the scaling goes into the float32 copy of the queries (c × Dh, not c × Tk, values)."""
    batch, n_kv, group, count, head_dim = q.shape
    if float32_out:
        scores = torch.bmm(q.reshape(batch * n_kv, group * count, head_dim), keys_t, out_dtype=torch.float32)
        scores.mul_(rule.scaling)
    else:
        scaled = q.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(rule.scaling)
        scores = torch.bmm(scaled.view(batch * n_kv, group * count, head_dim), keys_t)
    scores = scores.view(batch, n_kv * group, count, keys_t.shape[-1])
    if rule.softcap:
        scores.div_(rule.softcap).tanh_().mul_(rule.softcap)
    return scores


def _probabilities(scores: torch.Tensor, positions: torch.Tensor, offset: int, mask_rows: torch.Tensor | None,
                   key_ok: torch.Tensor, rule: ScoreRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over keys of masked scores [B, H, c, Tk], and which rows attend anything at all ([Bx, Hx, c, 1]):
    a fully masked row is made finite here and zeroed by its caller, so no NaN ever reaches a sum."""
    n_keys = scores.shape[-1]
    allowed = key_ok[:, None, None, :]  # [B, 1, 1, Tk]
    if mask_rows is None:
        if rule.causal:
            key_index = torch.arange(n_keys, device=scores.device)
            allowed = allowed & (key_index <= positions[..., None] + offset)[:, None]
    elif mask_rows.dtype == torch.bool:
        allowed = allowed & mask_rows
    else:
        allowed = allowed & (mask_rows != float("-inf"))
    blocked = ~allowed
    alive = ~blocked.all(dim=-1, keepdim=True)
    if mask_rows is not None and mask_rows.dtype != torch.bool:
        scores.add_(torch.where(alive, mask_rows, 0.0))
    blocked &= alive
    scores.masked_fill_(blocked, float("-inf"))
    return torch.softmax(scores, dim=-1), alive


def _float32_out_product(query: torch.Tensor) -> bool:
    """Whether q·k can run in the model's half precision with a float32 output on this device (CUDA's
    tensor cores, torch >= 2.9); else q and k are copied to float32 (same products, same float32 sums)."""
    device = query.device.type
    if device != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if device not in _FLOAT32_OUT_PRODUCT:
        probe = torch.ones(1, 1, 1, dtype=query.dtype, device=query.device)
        try:
            ran = torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError):
            ran = False
        _FLOAT32_OUT_PRODUCT[device] = ran
    return _FLOAT32_OUT_PRODUCT[device]
