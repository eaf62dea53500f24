"""D1's throughput with P probe processes at once on one machine: what the driver does once pooling is done.

Once the extractor leaves, the driver runs up to one D1 task per core, each probing one (concept, layer) on the
GPU (probe_gpu_share): processes time-slice the GPU, and each one's host work (Python dispatch, numpy) runs on its
own core. One process's seconds a cell (d1_cost.py) therefore do not say how long 17 × 19 × 6 cells take; the
aggregate rate of P processes does. Each worker builds d1_cost's synthetic table for its own layer (d 4,096,
1,400 train / 600 test passages, 4 lexical types), waits at a barrier until every worker has built its table, then
probes its first `--cells` cells with reliability; the span is the first worker's start to the last one's end.

    python3 bench/d1_parallel.py --processes 8 --cells 19 --out $OUT/d1_p8.json
    .venv/bin/python bench/d1_parallel.py --processes 2 --cells 1 --d 256 --n-train 200 --n-test 100   # a check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALL_CELLS = 17 * 19 * 6  # PoolBench's concepts × the card's strategies × the default layers


def worker(args: argparse.Namespace) -> None:
    import torch
    from d1_cost import layer_table, passages

    from poolbench.prober import batched_cell
    from poolbench.prober.concept_probe import probe_pooled_cells

    torch.set_num_threads(args.threads)
    batched_cell.CPU_THREADS = args.threads
    items = passages(args.n_train, args.n_test)
    table = layer_table(items, args.cells, args.worker, args.d, seed=0)  # d1_cost's first `cells` strategies
    types = {p.id: p.domain for p in items}
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context before the barrier, not inside the span
    barrier = Path(args.barrier)
    (barrier / f"ready{args.worker}").touch()
    while len(list(barrier.glob("ready*"))) < args.processes:
        time.sleep(0.01)
    start, cpu0 = time.time(), time.process_time()
    records, _ = probe_pooled_cells(table, "concept", types=types)
    end = time.time()
    out = {"worker": args.worker, "start": start, "end": end, "seconds": end - start,
           "cpu_seconds": time.process_time() - cpu0, "cells": len(records) // 2,
           "cv_auroc": [r.cv_auroc for r in records if r.probe == "logistic"]}
    (barrier / f"result{args.worker}.json").write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--cells", type=int, default=19, help="cells each worker probes (of its layer's 19)")
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--n-train", type=int, default=1400)
    parser.add_argument("--n-test", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "d1_parallel.json")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from bench_io import run_header, write_result

    with tempfile.TemporaryDirectory(prefix="d1_parallel_") as barrier:
        common = [sys.executable, __file__, "--processes", str(args.processes), "--cells", str(args.cells),
                  "--d", str(args.d), "--n-train", str(args.n_train), "--n-test", str(args.n_test),
                  "--threads", str(args.threads), "--barrier", barrier]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                          os.environ.get("PYTHONPATH")]))}
        procs = [subprocess.Popen([*common, "--worker", str(k)], env=env) for k in range(args.processes)]
        failed = [k for k, p in enumerate(procs) if p.wait() != 0]
        if failed:
            sys.exit(f"d1_parallel: worker(s) {failed} failed")
        workers = [json.loads((Path(barrier) / f"result{k}.json").read_text()) for k in range(args.processes)]
    span = max(w["end"] for w in workers) - min(w["start"] for w in workers)
    cells = sum(w["cells"] for w in workers)
    rate = cells / span
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = run_header("d1_parallel", args, device)
    result.update({"processes": args.processes, "cells": cells, "span_seconds": span, "cells_per_second": rate,
                   "worker_seconds": [w["seconds"] for w in workers],
                   "worker_cpu_seconds": [w["cpu_seconds"] for w in workers],
                   "all_cells": ALL_CELLS, "all_cells_minutes": ALL_CELLS / rate / 60,
                   "extrapolated": True, "workers": workers})
    print(f"{args.processes} processes on {device}: {cells} cells in {span:.1f} s ({rate:.2f} cells/s, "
          f"{span / cells * args.processes:.2f} s a cell in each); {ALL_CELLS} cells ≈ {ALL_CELLS / rate / 60:.1f} "
          "min at this rate (extrapolated)", flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
