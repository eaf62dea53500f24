"""The bytes a pooled concept puts in the store, counted from its vectors before any is computed.

At the scale PoolBench's users run it (an 8B model's d = 4,096, 2,000 passages a concept, 6 layers, 17 concepts)
a concept's shards are ~10 GB at float32, most of them S3's per-head vectors (one d-vector per head, passage and
layer): ~170 GB a model. A store whose disk cannot hold that fails with ENOSPC an hour into the run; the driver
checks the room first (poolbench.driver.store_room), from this count. It counts the vectors' payload only (ids,
labels, Arrow's framing and the checksum sidecars come on top), so it is a lower bound and never refuses a run that
fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.pooler.iti import selects_heads
from poolbench.pooler.learned import is_learned
from poolbench.pooler.pooled_table import StoreDtype
from poolbench.pooler.spec import StrategySpec

VALUE_BYTES: dict[StoreDtype, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT32 = 4  # what stays float32 whatever the store dtype: S2's gradient sums, learned fits, heads' own outputs


def vector_bytes_per_passage_layer(specs: Sequence[StrategySpec], hidden_size: int, n_heads: int, head_dim: int,
                                   store_dtype: StoreDtype) -> int:
    """Vector bytes one passage adds to one layer's objects: a PooledTable row per strategy at the store dtype;
    for S3 (each supervised head-selecting strategy) every head's pooled vector at the store dtype and its own
    output at float32; S2's gradient sum; a learned aggregator's vector per outer fit (its folds and the whole
    train split) at float32."""
    width = VALUE_BYTES[store_dtype]
    total = len(specs) * hidden_size * width
    for spec in specs:
        if selects_heads(spec):
            total += n_heads * (hidden_size * width + head_dim * FLOAT32)
        if is_learned(spec):
            total += (int(spec.param("folds")) + 1) * hidden_size * FLOAT32
    if any("gradient" in spec.needs for spec in specs):
        total += hidden_size * FLOAT32
    return total


def write_copy_bytes_per_passage_layer(specs: Sequence[StrategySpec], hidden_size: int, n_heads: int,
                                       head_dim: int, store_dtype: StoreDtype, buffered: bool) -> int:
    """What a job's writers hold beside its float32 vectors at most, per passage and layer (one writer a layer, all
    at once), as ExtractorWorker._store writes: a writer lets go of a layer's float32 table once it has its
    encoded or single-chunk copy. At 16 bits, the encoded copy of a layer's larger table (half its float32 bytes)
    before its float32 table goes, then that copy and, where the store serialises a table in memory first
    (`buffered`: ArtifactStore's own way; the folder and S3 stores write a file, S3's a spool it uploads), its
    buffer: at most half the vectors. At float32 into a file (the folder's or S3's spool), the PooledTable rows'
    single-chunk copy (S3 the strategy's head tables are written as they are); into a buffered store, that copy or
    a table's serialised buffer: at most the vectors again."""
    held = vector_bytes_per_passage_layer(specs, hidden_size, n_heads, head_dim, "float32")
    if store_dtype != "float32":
        return held // 2
    return held if buffered else len(specs) * hidden_size * FLOAT32
