"""An S3 store's memory while it writes a table: spooled to a file and uploaded from it (S3Store._write_table, the
default since session 30) against serialised in memory first (ArtifactStore._write_table, S3's way before), on a
real S3 server (moto_server, started here on 127.0.0.1 as a child process; its memory is its own); and while it
reads one back: downloaded into a spool file and mapped (`read_mapped`, get_table since session 30) against read
whole into memory (`read_whole`, S3Store._read, get_table's way before; the table held until the sample ends).

The table is a pooled layer's shape: `--rows` float32 vectors of width `--d` (default 100,000 x 1,024: 410 MB).
The writing process's anonymous memory (RssAnon, /proc/self/status) is sampled every 5 ms on a thread; the peak
over what it held before the write is what the write added. `--paths` picks the paths (both by default), each run
`--repeats` times in turn on its own key; `peak_over_table` is each path's largest. Run one path a process for its
first write alone: pyarrow's memory pool keeps what a write freed, so a later write in the same process can reuse it
and read as less. Writes bench/results/s3_write_memory.json (--out).

    .venv/bin/python bench/s3_write_memory.py --rows 100000 --d 1024 --paths in_memory --repeats 1
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from bench_io import RESULTS, run_header, tests_module, write_result

from poolbench.store.arrow_tables import ipc_bytes_to_table
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.s3 import S3Store

S3_SERVER = tests_module("s3_server")  # the tests' real S3 server, started the same way


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_during(write) -> tuple[int, float]:
    """(the most anonymous memory seen above the level before `write`, its seconds), sampled every 5 ms."""
    base, peak, done = rss_anon(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    write()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return max(peak[0], rss_anon()) - base, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--paths", default="spooled,in_memory",
                        help="comma list: spooled, in_memory, read_mapped, read_whole")
    parser.add_argument("--port", type=int, default=None, help="moto_server's (default: a free one)")
    parser.add_argument("--out", type=Path, default=RESULTS / "s3_write_memory.json")
    args = parser.parse_args()
    values = np.random.default_rng(0).standard_normal(args.rows * args.d, dtype=np.float32)
    table = pa.table({"vector": pa.FixedSizeListArray.from_arrays(pa.array(values), args.d)})
    del values
    server = S3_SERVER.MotoServer(args.port)
    server.start()
    try:
        store = S3Store(server.make_bucket("bench"), "", server.endpoint, access_key=S3_SERVER.ACCESS_KEY,
                        secret_key=S3_SERVER.SECRET_KEY, region=S3_SERVER.REGION, read_timeout_s=120.0)
        held: list[pa.Table] = []  # a read's table, kept until its sample ends
        every = {"spooled": lambda key: store.put_table(key, table),
                 "in_memory": lambda key: ArtifactStore._write_table(store, key + ".arrow", table, {}),
                 "read_mapped": lambda key: held.append(store.get_table("stored")),
                 "read_whole": lambda key: held.append(ipc_bytes_to_table(store._read("stored.arrow").data))}
        paths = {name: every[name] for name in args.paths.split(",")}
        if any(name.startswith("read") for name in paths):
            store.put_table("stored", table)
        runs: dict[str, list[dict]] = {name: [] for name in paths}
        for repeat in range(args.repeats):
            for name, write in paths.items():
                added, seconds = peak_during(lambda: write(f"{name}-{repeat}"))  # noqa: B023
                assert not held or held[-1].equals(table)
                held.clear()
                runs[name].append({"added_bytes": added, "seconds": seconds})
                print(f"{name}: +{added / 1e6:,.0f} MB ({added / table.nbytes:.2f}x the table) in {seconds:.2f} s",
                      flush=True)
        for name in paths:  # the write paths store the same table, read back whole
            assert name.startswith("read") or store.get_table(f"{name}-0").equals(table)
    finally:
        server.stop()
    write_result({**run_header("s3_write_memory", args, "cpu"), "table_bytes": table.nbytes,
                  "runs": runs, "peak_over_table": {name: max(r["added_bytes"] for r in rs) / table.nbytes
                                                    for name, rs in runs.items()}}, args.out)


if __name__ == "__main__":
    main()
