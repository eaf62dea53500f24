"""A concept's pooled vectors taken out of the store once its D1 is stored (`run --drop-pooled`).

At the full corpus an 8B model's concept is ~10 GB of shards at float32, S3's per-head vectors most of it: 177 GB
for the 17 concepts, more than the disk of many a rented GPU machine. A D1 run needs a concept's vectors only until
its D1 records and per-passage scores are stored; what a later stage reads (steering's DiffMean vectors, the
first-order steerability section, `reliability`, the HTTP app's stored vectors) is then gone, and the run says so.

Order: the manifest first (the concept no longer reads as pooled), then each layer's PooledTable shard before its
companions (head, learned-fit and gradient-sum tables), the reverse of the writer's order: a drop cut short leaves
companions without a shard, which nothing reads and a re-pooling overwrites, never a shard without its heads.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.pooler.gradient_sums import gradient_table_key
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.learned import learned_table_key
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key


def pooled_keys(pooled_key: str, layers: Sequence[int]) -> list[str]:
    """Every key a concept's pooling may have stored at these layers, in the order they are dropped."""
    keys = [pooled_key]
    for layer in layers:
        shard = layer_shard_key(pooled_key, layer)
        keys += [shard, head_table_key(shard), learned_table_key(shard), gradient_table_key(shard)]
    return keys


def drop_pooled(store: ArtifactStore, pooled_key: str, layers: Sequence[int]) -> int:
    """Delete what the concept's pooling stored at `layers` (whatever of it is there); the number of artifacts
    deleted."""
    dropped = 0
    for key in pooled_keys(pooled_key, layers):
        if store.exists(key):
            store.delete(key)
            dropped += 1
    return dropped
