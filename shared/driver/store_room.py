"""Room in the store for the pooling a run has left, checked before its first forward.

At the full corpus an 8B model's concept is ~10 GB of shards at float32 (S3's per-head vectors most of it),
~170 GB for PoolBench's 17 concepts at 6 layers: more than many a rented GPU machine's disk. Without this check
such a run pools for an hour, then stops at the concept that meets ENOSPC. A folder store's free space is
compared with a lower bound of the bytes (the vectors' payload: pooler.stored_size), so a run that fits is never
refused; an S3 store is not checked (its room is the bucket's business). With --drop-pooled a concept's vectors
leave once its D1 is stored and the pooling runs only as far ahead as the room allows (room_gate.py): then the
largest concept must fit, not the sum.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from poolbench.byte_size import size
from poolbench.errors import StoreError
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.local import LocalStore

from .run_plan import ConceptPlan

# The share of the disk's free bytes a --drop-pooled run plans into (its concepts' vector files and D1 files,
# room_gate.py); the rest for what it does not count (the concepts' parses, ~23 MB each at the full corpus) and
# whatever else writes to that disk meanwhile.
ROOM_SHARE = 0.9


def pooling_bytes(to_pool: list[tuple[ConceptPlan, list[int]]], per_passage_layer: int) -> int:
    """The vector bytes of the pooling left: every missing layer of every concept still to pool."""
    return per_passage_layer * sum(len(plan.passages) * len(missing) for plan, missing in to_pool)


def free_room(store: ArtifactStore, free_bytes: Callable[[Path], int] | None = None) -> int | None:
    """The bytes free on a folder store's disk; None for a store whose room is not ours to count (S3)."""
    if not isinstance(store, LocalStore):
        return None
    return (free_bytes or _disk_free)(store.root)


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_store_room(store: ArtifactStore, to_pool: list[tuple[ConceptPlan, list[int]]],
                     per_passage_layer: Callable[[], int], store_dtype: str, *, steering: bool = True,
                     free_bytes: Callable[[Path], int] | None = None) -> int | None:
    """The bytes the pooling left needs at least (None when nothing is left or the store is not a folder); stops
    with one line naming the store, the bytes and the way out when its disk has less free."""
    free = free_room(store, free_bytes) if to_pool else None
    if free is None:
        return None
    needed = pooling_bytes(to_pool, per_passage_layer())
    if needed > free:
        smaller = _smaller(store_dtype)
        concepts = f"{len(to_pool)} concept{'s' if len(to_pool) != 1 else ''}"
        dropping = ("--drop-pooled (each concept's vectors leave the store once its D1 is stored"
                    f"{'; with --no-steering' if steering else ''}), ")
        raise StoreError(
            f"store {store.describe()}: the pooling left ({concepts}, {sum(len(p.passages) for p, _ in to_pool)} "
            f"passages) needs at least {size(needed)} and its disk has {size(free)} free: use {smaller}{dropping}"
            "fewer --layers, or a store with room (--store DIR or --store s3://BUCKET/PREFIX)")
    return needed


def _smaller(store_dtype: str) -> str:
    return "--store-dtype bfloat16 (16-bit vectors, about half), " if store_dtype == "float32" else ""


def room_now(store: ArtifactStore) -> int:
    """The bytes a --drop-pooled run may plan into now (its vector and D1 files): ROOM_SHARE of the disk's free."""
    return int(ROOM_SHARE * (free_room(store) or 0))


def pooling_room(store: ArtifactStore, to_pool: list[tuple[ConceptPlan, list[int]]],
                 per_passage_layer: Callable[[], int], store_dtype: str,
                 free_bytes: Callable[[Path], int] | None = None) -> tuple[int | None, int | None]:
    """(room, free) for a --drop-pooled run at its start: room_now and the disk's free bytes (the room is read again
    at each decision of the room gate); (None, None) for a store whose room is not counted (S3) or where nothing is
    left to pool. Stops with one line when the largest concept alone does not fit
    the room: its D1 needs all its layers stored at once."""
    free = free_room(store, free_bytes) if to_pool else None
    if free is None:
        return None, None
    room = int(ROOM_SHARE * free)
    plan, layers = max(to_pool, key=lambda item: len(item[0].passages) * len(item[1]))
    needed = pooling_bytes([(plan, layers)], per_passage_layer())
    if needed > room:
        smaller = _smaller(store_dtype)
        raise StoreError(
            f"store {store.describe()}: with --drop-pooled the largest concept's pooling (concept {plan.concept}, "
            f"{len(plan.passages)} passages) needs at least {size(needed)} and the store may fill {size(room)} "
            f"({ROOM_SHARE:.0%} of its disk's {size(free)} free): use {smaller}fewer --layers, or a store with room "
            "(--store DIR or --store s3://BUCKET/PREFIX)")
    return room, free
