"""D1 with reliability of one concept: synthetic pooled tables (strategies × layers at width d) through the prober.

`--path batched` probes every cell with the batched solver (batched_cell), `--path per_fit` with today's
one-fit-at-a-time estimators; `--cells K` times only the first K cells of the first layer and extrapolates to all
strategies × layers (said so in the JSON). Writes bench/results/d1_cost.json (or --out).

    .venv/bin/python bench/d1_cost.py --path batched --threads 2
    .venv/bin/python bench/d1_cost.py --path per_fit --cells 1
    python3 bench/d1_cost.py --cells 19 --profile 40       # on a GPU: one layer, and where its seconds go

`--profile N` runs the probing under cProfile and prints its N heaviest functions by own time and by cumulative
time (on a GPU the fits' kernels run behind the host, so host waits show where the device is the bottleneck).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from bench_io import run_header, write_result
from torch.utils._python_dispatch import TorchDispatchMode

from poolbench.corpus.passage import Passage
from poolbench.pooler.iti import HEADS_META, ITIHeadTableBuilder
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.prober import batched_cell, batched_logistic, concept_probe
from poolbench.prober.concept_probe import probe_pooled_cells

DOMAINS = 4  # lexical types, so the control task (selectivity) runs as on the real corpus
S3 = "S3_iti_probe"


def passages(n_train: int, n_test: int) -> list[Passage]:
    """Matched pairs (one positive, one negative each), DOMAINS lexical types, the corpus's train/test split."""
    out = []
    for split, n in (("train", n_train), ("test", n_test)):
        for i in range(n // 2):
            for label in (1, 0):
                out.append(Passage(f"{split}-{i}-{label}", "text", label, f"d{i % DOMAINS}", 400, f"{split}-{i}",
                                   split, "concept"))
    return out


def layer_table(items: list[Passage], strategies: int, layer: int, d: int, seed: int):
    """One layer's PooledTable: per strategy an anisotropic Gaussian cloud with a concept direction whose strength
    grows with the strategy index (AUROCs from ~0.6 to ~0.95), and a per-domain offset (content)."""
    rng = np.random.default_rng(seed + layer)
    y = np.array([p.label for p in items], dtype=np.float32)
    dom = np.array([int(p.domain[1:]) for p in items])
    vectors = np.empty((1, strategies, len(items), d), dtype=np.float32)
    scale = rng.uniform(0.3, 3.0, size=d).astype(np.float32)
    for s in range(strategies):
        direction = rng.normal(size=d).astype(np.float32) / np.sqrt(d)
        offsets = rng.normal(size=(DOMAINS, d)).astype(np.float32) * 0.3
        X = rng.normal(size=(len(items), d)).astype(np.float32) * scale + offsets[dom]
        vectors[0, s] = X + np.outer(y, direction) * (0.5 + 0.1 * s) * np.sqrt(d) * 0.05
    builder = PooledTableBuilder(items, d)
    builder.add(vectors, [layer], [f"S{s:02d}" for s in range(strategies)], [p.id for p in items],
                np.zeros((strategies, len(items)), bool))
    return builder.table()


def s3_tables(items: list[Passage], heads: int, layer: int, d: int, seed: int) -> tuple[pa.Table, pa.Table]:
    """One layer's S3 cell as the driver stores it: a PooledTable row a passage (the mean of its heads' pooled
    vectors) naming its head count, and its ITIHeadTable (each head's pooled vector [d] and its own output
    [d / heads]), the concept in a quarter of the heads, strongest in the first. The synthetic cells above have
    no S3, whose head rankings and per-fold designs are a layer task's own work (bench/README.md, session 38)."""
    rng = np.random.default_rng(seed + 1000 + layer)
    y = np.array([p.label for p in items], dtype=np.float32)
    width = d // heads
    strength = np.where(np.arange(heads) < max(1, heads // 4), 0.6 / (1 + np.arange(heads)), 0.0)
    outputs = rng.normal(size=(1, len(items), heads, width)).astype(np.float32)
    outputs[..., 0] += (2 * y - 1)[None, :, None] * strength
    pooled = rng.normal(size=(1, len(items), heads, d)).astype(np.float32)
    pooled[..., 0] += (2 * y - 1)[None, :, None] * strength
    ids = [p.id for p in items]
    head_builder = ITIHeadTableBuilder(d)
    head_builder.add(S3, [layer], ids, pooled, outputs)
    builder = PooledTableBuilder(items, d)
    builder.add(pooled.mean(axis=2)[:, None], [layer], [S3], ids, np.zeros((1, len(items)), bool))
    return builder.table({f"{S3}{HEADS_META}": str(heads)}), head_builder.table()


def s3_cell(items: list[Passage], types: dict[str, str], layer: int, args: argparse.Namespace) -> dict:
    """Time one layer's S3 cell through the prober on its own (its records beside the others' would mix two costs):
    on a GPU its rankings and logistic fits run there (supervised.py), on a CPU on the host's estimators."""
    table, heads = s3_tables(items, args.s3_heads, layer, args.d, seed=0)
    start, cpu0 = time.perf_counter(), time.process_time()
    records, _ = probe_pooled_cells(table, "concept", types=types, heads=heads, batched=args.path == "batched")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    print(f"layer {layer}: S3's cell ({args.s3_heads} heads) in {seconds:.1f} s ({cpu:.1f} CPU-s)", flush=True)
    return {"s3_seconds": seconds, "s3_cpu_seconds": cpu, "s3_heads": args.s3_heads,
            "s3_cv_auroc": [r.cv_auroc for r in records if r.probe == "logistic"],
            "s3_heads_selected": [r.heads_selected for r in records if r.probe == "logistic"]}


class OpCounter(TorchDispatchMode):
    """Counts the torch ops the probing dispatches (on a GPU each is a launch or a host-side op) and among them the
    ones that wait for the device (a tensor read as a Python number or a mask's nonzero)."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += str(func.overloadpacket) in self.SYNCS
        return func(*args, **(kwargs or {}))


def print_profile(profiler: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
        print(f"--- cProfile by {key} ---\n{text.getvalue()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("batched", "per_fit"), default="batched")
    parser.add_argument("--strategies", type=int, default=19)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--n-train", type=int, default=1400)
    parser.add_argument("--n-test", type=int, default=600)
    parser.add_argument("--cells", type=int, default=0, help="time only the first K cells of the first layer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's N heaviest functions")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the torch ops and host syncs (item/bool/nonzero) the probing dispatches")
    parser.add_argument("--cuda-slices", action="store_true",
                        help="slice the fits' dual matrices as on a GPU (to count a GPU's ops on a CPU)")
    parser.add_argument("--cells-per-call", type=int, default=0,
                        help="cells of a layer probed in one batched call (default: the device's, 1 on a CPU)")
    parser.add_argument("--s3-heads", type=int, default=0,
                        help="also time an S3 cell a layer with this many heads (the 8B shape: 32), on its own")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "d1_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batched_cell.CPU_THREADS = args.threads
    if args.cells_per_call:
        concept_probe.cells_per_call = lambda _device: args.cells_per_call
    if args.cuda_slices:
        batched_logistic._CHUNK_ENTRIES = batched_logistic._CHUNK_ENTRIES_CUDA
    items = passages(args.n_train, args.n_test)
    types = {p.id: p.domain for p in items}
    layers, per_layer = [], []
    for layer in range(args.layers):
        table = layer_table(items, args.strategies, layer, args.d, seed=0)
        if args.cells:
            keep = [f"S{s:02d}" for s in range(args.cells)]
            table = table.filter(pc.is_in(table.column("strategy"), value_set=pc.cast(keep, "string")))
        start = time.perf_counter()
        cpu0 = time.process_time()
        profiler = cProfile.Profile() if args.profile else None
        ops = OpCounter() if args.count_ops else contextlib.nullcontext()
        if profiler:
            profiler.enable()
        with ops:
            records, _ = probe_pooled_cells(table, "concept", types=types, batched=args.path == "batched")
        if profiler:
            profiler.disable()
            print_profile(profiler, args.profile)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        cells = len(records) // 2
        if isinstance(ops, OpCounter):
            print(f"layer {layer}: {ops.ops / cells:,.0f} torch ops and {ops.syncs / cells:,.0f} host syncs a cell",
                  flush=True)
        s3 = s3_cell(items, types, layer, args) if args.s3_heads else {}
        per_layer.append({"layer": layer, "cells": cells, "seconds": seconds, "cpu_seconds": cpu, **s3,
                          **({"torch_ops": ops.ops, "host_syncs": ops.syncs} if isinstance(ops, OpCounter) else {}),
                          "cv_auroc": [r.cv_auroc for r in records if r.probe == "logistic"],
                          "mdl_compression": [r.mdl_compression for r in records if r.probe == "logistic"]})
        layers.append(layer)
        print(f"layer {layer}: {cells} cells in {seconds:.1f} s ({cpu:.1f} CPU-s)", flush=True)
        if args.cells:
            break
    timed_cells = sum(r["cells"] for r in per_layer)
    seconds = sum(r["seconds"] for r in per_layer)
    all_cells = args.strategies * args.layers
    result = run_header("d1_cost", args, "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name())
    result.update({"load_average_after": os.getloadavg(), "timed_cells": timed_cells, "timed_seconds": seconds,
                   "seconds_per_cell": seconds / timed_cells, "cells": all_cells,
                   "seconds_all_cells": seconds if timed_cells == all_cells else seconds / timed_cells * all_cells,
                   "extrapolated": timed_cells != all_cells, "per_layer": per_layer})
    print(f"{args.path}: {seconds / timed_cells:.2f} s a cell; {all_cells} cells "
          f"{'≈ ' if result['extrapolated'] else ''}{result['seconds_all_cells'] / 60:.1f} min")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
