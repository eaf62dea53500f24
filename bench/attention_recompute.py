"""S1/S3's per-layer attention recomputation, chunked (today) against the full float32 maps (d17ca23, kept in
tests/attention_reference.py): seconds per call and the bytes it allocates (largest tensor, peak alive), on
synthetic q/k of a model's head shape with a causal 4-D bool mask (sdpa's) and left padding. Writes
bench/results/attention_recompute.json.

    python bench/attention_recompute.py --rows 4 --length 512 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_io import run_header, tests_module, write_result
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from poolbench.extractor import attention_inflow
from poolbench.extractor.attention_capture import _record, _Route, last_real_index


def reference_record():
    """The old float32 path, from the tests' copy."""
    return tests_module("attention_reference").fp32_reference_record

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}  # query heads, key heads, head size


class AllocationMeter(TorchDispatchMode):
    """Bytes of the storages ops create while they are alive: the largest one and the peak of their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.alive = self.peak = 0
        self.holders: dict[int, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.holders:
                if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == pointer
                       for t in pytree.tree_leaves((args, kwargs))):
                    continue  # a view of an input, or an in-place op: no new memory
                size = tensor.untyped_storage().nbytes()
                self.holders[pointer] = [size, 0]
                self.alive += size
                self.largest = max(self.largest, size)
                self.peak = max(self.peak, self.alive)
            self.holders[pointer][1] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out

    def _release(self, pointer: int) -> None:
        holder = self.holders[pointer]
        holder[1] -= 1
        if holder[1] == 0:
            self.alive -= holder[0]
            del self.holders[pointer]


def inputs(rows: int, shape: tuple[int, int, int], length: int, dtype: torch.dtype, device: str = "cpu",
           padded: bool = True):
    """Seeded q/k of the head shape, the real-token mask and sdpa's causal 4-D bool mask; `padded`: every row but
    the first left-padded by a quarter, as the extractor pads (else every token real, and no mask: is_causal)."""
    heads, kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, length, head_dim, generator=generator).to(device=device, dtype=dtype)
    key = torch.randn(rows, kv_heads, length, head_dim, generator=generator).to(device=device, dtype=dtype)
    real = torch.ones(rows, length, dtype=torch.bool, device=device)
    if not padded:
        return query, key, real, None
    real[1:, : length // 4] = False
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return query, key, real, (causal[None] & real[:, None, :])[:, None]


def measure(record, rows: int, shape: tuple[int, int, int], length: int, dtype: torch.dtype, repeats: int) -> dict:
    query, key, real, mask = inputs(rows, shape, length, dtype)
    module = SimpleNamespace(is_causal=True)

    def once() -> None:
        record(_Route(0, real, last_real_index(real), False, {}), module, query, key, mask, None, {})

    with torch.no_grad():
        once()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            once()
            seconds.append(time.perf_counter() - start)
        with AllocationMeter() as meter:
            once()
    return {"seconds_median": statistics.median(seconds), "seconds_min": min(seconds),
            "largest_tensor_bytes": meter.largest, "peak_alive_bytes": meter.peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget-mib", type=int, default=None, help="the query chunk's budget (default: the module's)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention_recompute.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.budget_mib:
        attention_inflow.CHUNK_BUDGET_BYTES = attention_inflow.HOST_CHUNK_BUDGET_BYTES = args.budget_mib * 2**20
    dtype = getattr(torch, args.dtype)
    result = run_header("attention_recompute", args, "cpu")
    result["shapes"] = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        old = measure(reference_record(), args.rows, shape, args.length, dtype, args.repeats)
        new = measure(_record, args.rows, shape, args.length, dtype, args.repeats)
        chunk = attention_inflow.query_chunk(args.rows, shape[0], args.length, args.length,
                                             attention_inflow.chunk_budget("cpu"))
        result["shapes"][name] = {"heads": shape, "chunk": chunk, "reference_fp32_maps": old, "chunked": new,
                                  "speedup": old["seconds_median"] / new["seconds_median"]}
        print(name, result["shapes"][name])
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
