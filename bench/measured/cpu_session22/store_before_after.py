"""A 400-passage concept's shards written by ExtractorWorker._store, timed: run from bench/ on the tree before and
after 70bd388 in turn (before: no `writers` argument, one object after another)."""

import inspect
import sys
import tempfile
import time

sys.path.insert(0, "/work/main/bench")
import shard_writes as sw

from poolbench.pooler.worker import ExtractorWorker, PoolTask
from poolbench.store.local import LocalStore

layers = list(range(6))
concept = sw.synthetic_concept(int(sys.argv[1]), layers, 19, 32, 128, 4096)
nbytes = sum(t.nbytes for t in concept.tables.values()) + sum(t.nbytes for t in (concept.heads or {}).values())
has_writers = "writers" in inspect.signature(ExtractorWorker._store).parameters
for writers in [1, 2] if has_writers else [None]:
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        start = time.perf_counter()
        options = {"writers": writers} if has_writers else {}
        ExtractorWorker._store(LocalStore(root), PoolTask("c", [], "pooled/c", {}, tuple(layers)), layers, concept,
                               "float32", layers, **options)
        seconds = time.perf_counter() - start
    rate = nbytes / 1e9 / seconds
    print(f"{'after' if has_writers else 'before'} writers={writers}: {nbytes / 1e9:.2f} GB in {seconds:.2f} s "
          f"({rate:.2f} GB/s)", flush=True)
