"""Milliseconds per layer of device pooling (DevicePooler: every layer's calls, then finish) at a real shape, for this
tree's pooler and, with --old FILE (a device_pool.py of an earlier commit), for that one on the same machine.

19 strategy rows: the 13 card strategies that need no parse (A1-A4, P1-P2, W1-W4, S1 x2, S2 x2, S3) and 6 more
window rows standing in for L1-L6 (parse weights are static rows too). Random states and extras, padding on the
right, a sink-sized first token. Prints one JSON line per (pooler, dtype, d)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch

from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.registry import list_strategies
from poolbench.pooler.windows import window_spec


def strategies() -> list:
    card = [s for s in list_strategies() if "parse" not in s.needs]
    return card + [window_spec(code, k=k) for code in ("W1", "W2", "W3") for k in (2, 3)]


def inputs(batch: int, length: int, dim: int, heads: int, head_dim: int, layers: int, dtype: torch.dtype,
           device: str):
    rng = np.random.default_rng(0)
    lengths = rng.integers(length // 2, length + 1, batch)
    mask = np.arange(length)[None, :] < lengths[:, None]
    chunk = PaddedBatch(list(range(batch)), [f"p{b}" for b in range(batch)], ["text"] * batch,
                        rng.integers(0, 100, (batch, length)), mask, np.zeros((batch, length, 2), np.int32),
                        np.zeros_like(mask))
    gen = torch.Generator(device=device).manual_seed(0)
    per_layer = []
    for _ in range(layers):
        hidden = torch.randn(batch, length, dim, generator=gen, device=device).to(dtype)
        hidden[:, 0] *= 50
        inflow = torch.rand(batch, heads, length, generator=gen, device=device)
        extras = {"attention_head_inflow": inflow, "attention_head_inflow_last": inflow.flip(-1),
                  "attention_head_output_last": torch.randn(batch, heads, head_dim, generator=gen, device=device),
                  "gradient_norm": torch.rand(batch, length, generator=gen, device=device),
                  "gradient_x_input": torch.rand(batch, length, generator=gen, device=device)}
        per_layer.append((hidden, extras))
    return chunk, per_layer


def seconds_per_layer(makers: dict, per_layer, device: str, repeats: int) -> dict[str, float]:
    """Median seconds per layer of each pooler, the poolers taking turns (a busy machine drifts alike for all)."""
    times: dict[str, list[float]] = {name: [] for name in makers}
    for r in range(repeats + 1):
        for name, make in makers.items():
            if device == "cuda":
                torch.cuda.synchronize()
            pooler = make()
            start = time.perf_counter()
            for layer, (hidden, extras) in enumerate(per_layer):
                pooler(layer, hidden, extras)
            pooler.finish()
            if r:  # the first turn warms up
                times[name].append((time.perf_counter() - start) / len(per_layer))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dims", default="576,4096")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--old", default=None, help="an earlier device_pool.py to time beside this tree's")
    args = parser.parse_args()
    poolers = {}
    if args.old:
        spec = importlib.util.spec_from_file_location("old_device_pool", args.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_device_pool"] = old
        spec.loader.exec_module(old)
        poolers["old"] = old.DevicePooler
    from poolbench.pooler.device_pool import DevicePooler, HostBuffers
    buffers = HostBuffers(pin=args.device == "cuda")
    poolers["new"] = lambda *a: DevicePooler(*a, buffers=buffers)
    specs = strategies()
    for dim in (int(d) for d in args.dims.split(",")):
        heads, head_dim = (32, 128) if dim >= 2048 else (9, 64)
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            chunk, per_layer = inputs(args.batch, args.length, dim, heads, head_dim, args.layers, dtype, args.device)
            makers = {label: partial(cls, specs, chunk, range(args.layers), {}, torch.device(args.device))
                      for label, cls in poolers.items()}
            for label, seconds in seconds_per_layer(makers, per_layer, args.device, args.repeats).items():
                print(json.dumps({"pooler": label, "device": torch.cuda.get_device_name() if args.device == "cuda"
                                  else "cpu", "threads": torch.get_num_threads(), "dtype": name, "B": args.batch,
                                  "T": args.length, "d": dim, "strategies": len(specs), "layers": args.layers,
                                  "ms_per_layer": round(1e3 * seconds, 3)}), flush=True)

if __name__ == "__main__":
    main()
