"""A pooled concept's store writes, as the extractor does them after its last forward: every layer's PooledTable
shard and its S3 ITIHeadTable (ExtractorWorker._store, encode and combine included), on 1 and on N writer threads.

At the full corpus one concept at d 4,096 is ~3.7 GB of pooled vectors and ~6.5 GB of per-head vectors over 6
layers; on the H100 (bench/measured/h100_session20) the driver's gap between two concepts' pooling held ~13 s of
these writes for 800 passages, the GPU idle meanwhile. Synthetic vectors (the bytes' values do not change the
cost), real builders and a real LocalStore in --store (a temporary folder by default: the disk it is on is what
gets measured). Writes bench/results/shard_writes.json.

    .venv/bin/python bench/shard_writes.py --passages 400 --writers 1,2 [--store-dtype bfloat16]
    python3 bench/shard_writes.py --passages 2000 --writers 1,4,8 --store /tmp/shards    # a GPU host, full corpus
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from bench_io import run_header, write_result

from poolbench.corpus.passage import Passage
from poolbench.pooler.iti import ITIHeadTableBuilder
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.pooler.worker import ExtractorWorker, PoolTask, _Pooled, shard_writers
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.local import LocalStore


def synthetic_concept(passages: int, layers: list[int], strategies: int, heads: int, head_dim: int, d: int,
                      chunk: int = 32) -> _Pooled:
    """A concept's tables built chunk by chunk through the pooling's own builders, as the capture fills them."""
    rng = np.random.default_rng(0)
    items = [Passage(id=f"p{i}", text="", label=i % 2, domain="d", token_count=400, matched_pair_id=f"m{i // 2}",
                     split="train" if i % 10 < 7 else "test", concept="c") for i in range(passages)]
    pooled = PooledTableBuilder(items, d)
    head_builders = {layer: ITIHeadTableBuilder(d) for layer in layers}
    ids = [f"s{s}" for s in range(strategies)]
    for start in range(0, passages, chunk):
        rows = [p.id for p in items[start:start + chunk]]
        vectors = rng.standard_normal((len(layers), strategies, len(rows), d), dtype=np.float32)
        pooled.add(vectors, layers, ids, rows, np.zeros((strategies, len(rows)), dtype=bool))
        for layer in layers:
            per_head = rng.standard_normal((1, len(rows), heads, d), dtype=np.float32)
            outputs = rng.standard_normal((1, len(rows), heads, head_dim), dtype=np.float32)
            head_builders[layer].add("S3_iti_probe", [layer], rows, per_head, outputs)
    tables = pooled.layer_tables({"concept": "c"})
    return _Pooled(tables, {layer: b.table() for layer, b in head_builders.items()}, (), 0, 0.0, None)


def whole(concept: _Pooled) -> _Pooled:
    """The concept with dicts of its own: _store lets go of each layer's tables as it writes them (a job's memory
    falls as it writes), and a timed repeat writes the same tables again."""
    return replace(concept, tables=dict(concept.tables), heads=dict(concept.heads or {}))


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): a private copy counts, a mapped file's pages do not."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def peak_anonymous_bytes(work, every_s: float = 0.005) -> tuple[object, int]:
    """work()'s result and the most anonymous memory this process held while it ran (sampled every `every_s`)."""
    import threading

    peak, done = [anonymous_bytes()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            done.wait(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = work()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], anonymous_bytes())


class BufferedFolder(LocalStore):
    """A folder store that serialises each table in memory first (ArtifactStore's way, an S3 store's before session
    30): the write path's memory with a buffered store, measured without an S3 server."""

    buffers_tables = True

    def _write_table(self, name, table, metadata) -> None:
        ArtifactStore._write_table(self, name, table, metadata)


def memory_against_the_plan(args: argparse.Namespace, layers: list[int]) -> dict:
    """A concept's host memory as the pooling job holds it (its builders' tables) and at its peak while written,
    against what driver/host_room.py plans for it (VectorBytes: the vectors held at float32, what the writers add
    beside them, JOB_FIXED), so the plan is checked against the process it describes."""
    from poolbench.driver.host_room import VectorBytes
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.pooler.stored_size import vector_bytes_per_passage_layer, write_copy_bytes_per_passage_layer

    # the synthetic concept's rows as the driver counts them: S3 (its heads) and plain rows for the others
    specs = [*resolve_strategies(["A1_mean"]) * (args.strategies - 1), *resolve_strategies(["S3_iti_probe"])]
    shape = (specs, args.d, args.heads, args.head_dim)
    store_kind = BufferedFolder if args.buffered else LocalStore
    per = VectorBytes(vector_bytes_per_passage_layer(*shape, "float32"),
                      write_copy_bytes_per_passage_layer(*shape, args.store_dtype, store_kind.buffers_tables))
    planned_held, planned_peak = per.held * args.passages * len(layers), per.peak(args.passages * len(layers))
    base = anonymous_bytes()
    concept, built_peak = peak_anonymous_bytes(lambda: synthetic_concept(
        args.passages, layers, args.strategies, args.heads, args.head_dim, args.d))
    held = anonymous_bytes() - base
    with tempfile.TemporaryDirectory(dir=args.store) as root:
        task = PoolTask("c", [], "pooled/c", {}, tuple(layers))
        _, write_peak = peak_anonymous_bytes(lambda: ExtractorWorker._store(
            store_kind(Path(root)), task, layers, concept, args.store_dtype, layers, writers=args.memory_writers))
    out = {"writers": shard_writers(len(layers), args.memory_writers), "buffered": args.buffered,
           "planned_held_bytes": planned_held, "planned_peak_bytes": planned_peak, "held_bytes": held,
           "build_peak_bytes": built_peak - base, "write_peak_bytes": write_peak - base}
    print(f"memory: held {held / 1e9:.2f} GB (planned {planned_held / 1e9:.2f}), peak while building "
          f"{out['build_peak_bytes'] / 1e9:.2f} GB, while written on {out['writers']} writer(s) "
          f"{out['write_peak_bytes'] / 1e9:.2f} GB = {out['write_peak_bytes'] / held:.2f}x the vectors "
          f"(planned {planned_peak / 1e9:.2f} GB = {planned_peak / planned_held:.2f}x)", flush=True)
    return out


def read_back(store: LocalStore, layers: list[int], repeats: int) -> dict:
    """Every layer's shard and head table read as a D1 task reads them (sha256 checked), interleaved: copied into
    the process (read_bytes, as before session 23) and mapped (get_table now); seconds and anonymous memory held."""
    from poolbench.pooler.iti import head_table_key
    from poolbench.store.arrow_tables import ipc_bytes_to_table
    from poolbench.store.keys import layer_shard_key

    keys = [k for layer in layers for k in (layer_shard_key("pooled/c", layer), head_table_key(layer_shard_key(
        "pooled/c", layer)))]
    ways = {"copied": lambda key: ipc_bytes_to_table(store._get(key, ".arrow").data), "mapped": store.get_table}
    out: dict[str, dict[str, list[float]]] = {way: {"seconds": [], "anonymous_bytes": []} for way in ways}
    for _ in range(repeats):
        for way, read in ways.items():
            before, start = anonymous_bytes(), time.perf_counter()
            tables = [read(key) for key in keys]
            out[way]["seconds"].append(time.perf_counter() - start)
            out[way]["anonymous_bytes"].append(anonymous_bytes() - before)
            print(f"read back {way}: {sum(t.nbytes for t in tables) / 1e9:.2f} GB in {out[way]['seconds'][-1]:.2f} s,"
                  f" {out[way]['anonymous_bytes'][-1] / 1e9:.2f} GB of anonymous memory held", flush=True)
            del tables
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--strategies", type=int, default=19, help="PooledTable rows a passage and layer")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--writers", default="1,2", help="comma list of writer thread counts, each timed")
    parser.add_argument("--repeats", type=int, default=2, help="best of")
    parser.add_argument("--store-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="the run's --store-dtype: 16 bits encode the vectors first (S3's heads too)")
    parser.add_argument("--store", type=Path, default=None, help="folder for the stores (default: a temporary one)")
    parser.add_argument("--read-back", action="store_true",
                        help="then read every table back as a D1 task does, copied (before) and mapped (now)")
    parser.add_argument("--memory", action="store_true",
                        help="only the host memory a concept holds and peaks at while written, against the driver's "
                             "plan for it (driver/host_room.py)")
    parser.add_argument("--buffered", action="store_true",
                        help="in --memory, a folder store that serialises each table in memory first (the base "
                             "ArtifactStore's way)")
    parser.add_argument("--memory-writers", type=int, default=None,
                        help="writer threads in --memory (default: the extractor's own, one a layer up to the cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shard_writes.json")
    args = parser.parse_args()
    layers = list(range(args.layers))
    if args.memory:
        write_result({**run_header("shard_writes", args, "cpu"), "memory": memory_against_the_plan(args, layers)},
                     args.out)
        return
    concept = synthetic_concept(args.passages, layers, args.strategies, args.heads, args.head_dim, args.d)
    nbytes = sum(t.nbytes for t in concept.tables.values()) + sum(t.nbytes for t in (concept.heads or {}).values())
    result = run_header("shard_writes", args, "cpu")
    result.update(bytes=nbytes, runs={})
    with tempfile.TemporaryDirectory(dir=args.store) as root:
        for repeat in range(args.repeats):
            for writers in (int(w) for w in args.writers.split(",")):
                store = LocalStore(Path(root) / f"w{writers}-r{repeat}")
                task = PoolTask("c", [], "pooled/c", {}, tuple(layers))
                start = time.perf_counter()
                ExtractorWorker._store(store, task, layers, whole(concept), args.store_dtype, layers,
                                       writers=writers)
                seconds = time.perf_counter() - start
                result["runs"].setdefault(str(writers), []).append(seconds)
                on_disk = sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file())
                result["bytes_on_disk"] = on_disk
                rate = nbytes / 1e9 / seconds
                print(f"{writers} writer(s): {nbytes / 1e9:.2f} GB of float32 tables in {seconds:.2f} s "
                      f"({rate:.2f} GB/s), {on_disk / 1e9:.2f} GB on disk at {args.store_dtype}", flush=True)
        if args.read_back:  # the last store written, read back --repeats times
            result["reads"] = read_back(store, layers, args.repeats)
    result["best_s"] = {w: min(s) for w, s in result["runs"].items()}
    result["gb_per_s"] = {w: nbytes / 1e9 / s for w, s in result["best_s"].items()}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
