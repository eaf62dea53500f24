"""Room in the store for the pooling a run has left, checked before its first forward.

At the full corpus an 8B model's concept is ~10 GB of shards at float32 (S3's per-head vectors most of it),
~170 GB for PoolBench's 17 concepts at 6 layers: more than many a rented GPU machine's disk. Without this check
such a run pools for an hour, then stops at the concept that meets ENOSPC. A folder store's free space is
compared with a lower bound of the bytes (the vectors' payload: pooler.stored_size), so a run that fits is never
refused; an S3 store is not checked (its room is the bucket's business).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from poolbench.errors import StoreError
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.local import LocalStore

from .run_plan import ConceptPlan

GB = 1e9


def pooling_bytes(to_pool: list[tuple[ConceptPlan, list[int]]], per_passage_layer: int) -> int:
    """The vector bytes of the pooling left: every missing layer of every concept still to pool."""
    return per_passage_layer * sum(len(plan.passages) * len(missing) for plan, missing in to_pool)


def check_store_room(store: ArtifactStore, to_pool: list[tuple[ConceptPlan, list[int]]],
                     per_passage_layer: Callable[[], int], store_dtype: str,
                     free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free) -> int | None:
    """The bytes the pooling left needs at least (None when nothing is left or the store is not a folder); stops
    with one line naming the store, the bytes and the way out when its disk has less free."""
    if not to_pool or not isinstance(store, LocalStore):
        return None
    needed = pooling_bytes(to_pool, per_passage_layer())
    free = free_bytes(store.root)
    if needed > free:
        smaller = "--store-dtype bfloat16 (16-bit vectors, about half), " if store_dtype == "float32" else ""
        concepts = f"{len(to_pool)} concept{'s' if len(to_pool) != 1 else ''}"
        raise StoreError(
            f"store {store.describe()}: the pooling left ({concepts}, {sum(len(p.passages) for p, _ in to_pool)} "
            f"passages) needs at least {size(needed)} and its disk has {size(free)} free: use {smaller}fewer "
            "--layers, or a store with room (--store DIR or --store s3://BUCKET/PREFIX)")
    return needed


def size(n_bytes: int) -> str:
    """Bytes as a person reads them: GB from 0.1 GB, MB from 0.1 MB, else bytes."""
    if n_bytes >= GB / 10:
        return f"{n_bytes / GB:.1f} GB"
    return f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 else f"{n_bytes} bytes"
