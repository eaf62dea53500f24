"""S1/S3's attention inflow three ways on one device: the chunked path (attention_inflow: float32 scores and
probabilities a query chunk at a time, ~15 kernels a chunk, 2.7 ms a layer on the H100 at 16 x 512 tokens: 37% of
the raw forward, bench/measured/h100_session30), the Triton kernel the capture takes on CUDA since session 31
(inflow_kernel: no map in memory, float32 round-off of the chunked path; timed where it compiles, i.e. on CUDA), and
a candidate through sdpa's backward: the attention each key receives from the real queries, Σ_i w_i P_ij, is
exactly the values' gradient of the attention output, dV = Pᵀ·dO, for dO = w on every value column, whatever the
values are, so one forward and one backward of the fused attention kernel (flash or memory-efficient on CUDA) give
it too.

The backward's catch, and why it stays a bench: a fused kernel works in the model's dtype: in bf16 each P_ij goes
into the dV product rounded to bf16 and dV comes out in bf16, so the inflow moves by up to a few parts in 2^9 of
itself (S1/S3's stored vectors with it), where the other two are float32 to round-off. The last query's row
(attention_inflow's `last`) is one query a passage and stays as it is; grouped-query heads get their key heads
repeated (the inflow is per query head).

    python bench/inflow_by_backward.py --device cuda --dtype bfloat16            # 8B heads, 16 x 512 tokens
    .venv/bin/python bench/inflow_by_backward.py --device cpu --dtype float32 --rows 2 --length 128
Writes bench/results/inflow_by_backward.json (--out).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_recompute import SHAPES, inputs
from bench_io import RESULTS, run_header, write_result

from poolbench.extractor import inflow_kernel
from poolbench.extractor.attention_capture import last_real_index
from poolbench.extractor.attention_inflow import ScoreRule, attention_inflow, chunk_budget, query_chunk


def inflow_by_backward(query: torch.Tensor, key: torch.Tensor, query_mask: torch.Tensor, scaling: float
                       ) -> torch.Tensor:
    """Mean inflow [B, H, Tk] float32 over the real queries of a causal layer (keys aligned with the queries),
    padding keys receiving nothing: attention_inflow's `mean`, through sdpa's backward."""
    batch, heads, length, head_dim = query.shape
    real = query_mask.to(device=query.device, dtype=torch.bool)
    keys = key.repeat_interleave(heads // key.shape[1], dim=1)
    mask = None
    if not bool(real.all()):  # padding keys blocked; a query that sees no key sees all (its weight is 0 anyway)
        allowed = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[None] & real[:, None, :]
        mask = (allowed | ~allowed.any(-1, keepdim=True))[:, None]
    with torch.inference_mode(False), torch.enable_grad():
        q, k = query.clone(), keys.clone()  # the capture's forwards run in inference mode: normal tensors here
        values = torch.zeros_like(q, requires_grad=True)
        out = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, is_causal=mask is None, scale=scaling)
        weights = real.to(query.dtype)[:, None, :, None].expand(batch, heads, length, head_dim)
        (grad,) = torch.autograd.grad(out, values, grad_outputs=weights.contiguous())
    n_real = real.sum(dim=1).clamp(min=1).to(torch.float32)
    return grad[..., 0].float() / n_real[:, None, None]


def timed(call, device: str, repeats: int) -> float:
    """The fastest of `repeats` calls, the device synchronised around each."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms the kernels
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def compare(rows: int, shape: tuple[int, int, int], length: int, dtype: torch.dtype, device: str, padded: bool,
            repeats: int) -> dict:
    query, key, real, mask = inputs(rows, shape, length, dtype, device, padded)  # sdpa's mask in a padded batch
    scaling = shape[2] ** -0.5
    rule = ScoreRule(scaling=scaling, softcap=None, causal=True, mask=mask)
    last = last_real_index(real)
    chunk = query_chunk(rows, shape[0], length, length, chunk_budget(device))  # the capture's chunk, named: no kernel
    kernel = torch.device(device).type == "cuda" and inflow_kernel.kernel_wanted(torch.device(device))
    with torch.inference_mode():
        query, key = query.clone(), key.clone()  # inference tensors, as the capture's forwards hand them
        today = attention_inflow(query, key, real, last, rule, chunk=chunk).mean
        candidate = inflow_by_backward(query, key, real, scaling)
        seconds_today = timed(lambda: attention_inflow(query, key, real, last, rule, chunk=chunk), device, repeats)
        seconds_candidate = timed(lambda: inflow_by_backward(query, key, real, scaling), device, repeats)
        by_kernel = attention_inflow(query, key, real, last, rule).mean if kernel else None
        seconds_kernel = timed(lambda: attention_inflow(query, key, real, last, rule), device, repeats) \
            if kernel else None
    keys_real = real[:, None, :].expand_as(today)
    big = today[keys_real].abs() >= 1e-3 * float(today.abs().max())  # where the inflow is not round-off itself

    def difference(other: torch.Tensor) -> tuple[float, float]:
        diff = (other - today).abs()
        relative = diff[keys_real] / today[keys_real].abs().clamp(min=torch.finfo(torch.float32).tiny)
        return float(diff.max()), float(relative[big].max())

    absolute, relative = difference(candidate)
    kernel_fields = {"seconds_kernel": seconds_kernel, "kernel_speedup": None, "kernel_max_abs_difference": None}
    if by_kernel is not None and seconds_kernel is not None:
        kernel_fields.update(kernel_speedup=seconds_today / seconds_kernel,
                             kernel_max_abs_difference=difference(by_kernel)[0])
    return {"rows": rows, "length": length, "padded": padded, "heads": shape, "chunk": chunk,
            "seconds_today": seconds_today, "seconds_candidate": seconds_candidate,
            "speedup": seconds_today / seconds_candidate, **kernel_fields,
            "max_abs_difference": absolute, "max_inflow": float(today.abs().max()),
            "max_relative_difference_where_inflow_over_1e-3_of_max": relative,
            "padding_keys_candidate_max": float(candidate[~keys_real].abs().max()) if padded else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "inflow_by_backward.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cases = [compare(args.rows, SHAPES[args.shape], args.length, dtype, args.device, padded, args.repeats)
             for padded in (False, True)]
    for case in cases:
        kernel = "" if case["seconds_kernel"] is None else (
            f"; the kernel {case['seconds_kernel'] * 1e3:.2f} ms ({case['kernel_speedup']:.2f}x, largest difference "
            f"{case['kernel_max_abs_difference']:.2e})")
        print(f"{'padded' if case['padded'] else 'packed'}: chunked {case['seconds_today'] * 1e3:.2f} ms, by the "
              f"backward {case['seconds_candidate'] * 1e3:.2f} ms ({case['speedup']:.2f}x); largest relative "
              f"difference {case['max_relative_difference_where_inflow_over_1e-3_of_max']:.2e}{kernel}", flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    write_result({**run_header("inflow_by_backward", args, name), "device_name": name, "cases": cases}, args.out)


if __name__ == "__main__":
    main()
