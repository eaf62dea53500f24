import sys, time, tempfile, inspect
sys.path.insert(0, "/work/main/bench")
import shard_writes as sw
from poolbench.pooler.worker import ExtractorWorker, PoolTask
from poolbench.store.local import LocalStore
layers = list(range(6))
c = sw.synthetic_concept(int(sys.argv[1]), layers, 19, 32, 128, 4096)
nbytes = sum(t.nbytes for t in c.tables.values()) + sum(t.nbytes for t in c.heads.values())
has_writers = "writers" in inspect.signature(ExtractorWorker._store).parameters
for writers in ([1, 2] if has_writers else [None]):
    with tempfile.TemporaryDirectory(dir="/tmp") as r:
        st = LocalStore(r)
        s = time.perf_counter()
        kw = {"writers": writers} if has_writers else {}
        ExtractorWorker._store(st, PoolTask("c", [], "pooled/c", {}, tuple(layers)), layers, c, "float32", layers, **kw)
        e = time.perf_counter() - s
    print(f"{'after' if has_writers else 'before'} writers={writers}: {nbytes/1e9:.2f} GB in {e:.2f} s ({nbytes/1e9/e:.2f} GB/s)", flush=True)
