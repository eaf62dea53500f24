"""S1/S3's attention recomputation as it was before query chunks (d17ca23), kept as the reference the chunked
path is tested and benchmarked against."""

from __future__ import annotations

import torch


def fp32_reference_record(route, module, query, key, attention_mask, output, kwargs) -> None:
    """The recomputation as it was before query chunks: every [B, H, T, T] temporary in float32."""
    q = query.float()
    k = key.float().repeat_interleave(q.shape[1] // key.shape[1], dim=1)
    scaling = kwargs.get("scaling") or q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    n_q, n_k = scores.shape[-2:]
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = None
    if attention_mask is None:
        if getattr(module, "is_causal", False):
            causal = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril(n_k - n_q)
            scores = scores.masked_fill(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :n_k], float("-inf"))
    else:
        scores = scores + attention_mask[..., :n_k].float()
    keys = route.query_mask.to(scores.device)
    scores = scores.masked_fill(~keys[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    queries = keys[:, None, :, None].to(probs.dtype)
    n_real = queries.sum(dim=2).clamp(min=1)
    rows = torch.arange(probs.shape[0], device=probs.device)
    last = route.last_index.to(probs.device)
    record = {"inflow": (probs * queries).sum(dim=2) / n_real, "inflow_last": probs[rows, :, last, :]}
    if route.head_outputs:
        record["head_output_last"] = output.float()[rows, last]
    route.out[route.layer] = record
