"""PooledTable: the durable Arrow form of pooled vectors, one row per (passage, layer, strategy).

Stored sharded: one table per (concept, layer) under `layer_shard_key(concept_key, layer)`, and a small JSON
manifest under the concept key written last, so a D1 task opens one layer and a concept counts as pooled only
when every shard is there. Vectors may be stored at 16 bits (float16, or bfloat16 as its uint16 bit pattern) and
are always read back as float32. Real strategies only: S3's per-head pooled vectors and head outputs live in its
ITIHeadTable (poolbench.pooler.iti), sharded the same way."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from poolbench.corpus.passage import Passage
from poolbench.errors import StoreError
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key

StoreDtype = Literal["float32", "float16", "bfloat16"]
STORE_DTYPES: tuple[StoreDtype, ...] = ("float32", "float16", "bfloat16")
DTYPE_META = b"poolbench.dtype"  # field metadata of "vector": the dtype the stored bits stand for
MANIFEST_FORMAT = "pooled-shards-1"
_FLOAT16_MAX = float(np.finfo(np.float16).max)
_ARROW_VALUES = {"float32": pa.float32(), "float16": pa.float16(), "bfloat16": pa.uint16()}  # each dtype's bits
_NUMPY_VALUES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def pooled_schema(hidden_size: int, store_dtype: StoreDtype = "float32") -> pa.Schema:
    """Vectors are fixed-size lists so a whole column converts to one [N, d] array without copies."""
    return pa.schema(
        [
            pa.field("passage_id", pa.string()),
            pa.field("label", pa.int8()),
            pa.field("split", pa.string()),
            pa.field("group", pa.string()),
            pa.field("layer", pa.int16()),
            pa.field("strategy", pa.string()),
            pa.field("fallback", pa.bool_()),
            _vector_field(hidden_size, store_dtype),
        ]
    )


def _vector_field(hidden_size: int, store_dtype: StoreDtype, name: str = "vector") -> pa.Field:
    return pa.field(name, pa.list_(_ARROW_VALUES[store_dtype], hidden_size),
                    metadata={DTYPE_META: store_dtype.encode()})


_BLOCK = 1 << 20  # values converted at a time: S3's head vectors are ~1 GB a layer at the full corpus and d 4,096


def bfloat16_bits(X: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even, as torch and XLA do.

    In blocks of _BLOCK values: the rounding needs 64-bit integers, four times the input's bytes at once otherwise."""
    flat = np.ascontiguousarray(X, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(flat.shape, dtype=np.uint16)
    for start in range(0, flat.size, _BLOCK):
        bits = flat[start:start + _BLOCK].astype(np.uint64)
        out[start:start + _BLOCK] = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return out.reshape(np.shape(X))


def bfloat16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they stand for (exact: bf16 is float32's top half)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def vector_dtype(table: pa.Table, column: str = "vector") -> StoreDtype:
    """The dtype a table's stored vectors stand for (tables from before 16-bit storage are float32)."""
    meta = table.schema.field(column).metadata or {}
    name = meta.get(DTYPE_META, b"float32").decode()
    if name not in STORE_DTYPES:
        raise StoreError(f"PooledTable: unknown vector dtype {name!r}")
    return cast(StoreDtype, name)


def stored_values(table: pa.Table, column: str = "vector") -> np.ndarray:
    """A vector column's stored values [N, d] (float32, float16 or uint16 bits); no copy for a one-chunk column,
    which is how shards are written, so a reader holds the vectors once."""
    vector = table.column(column).combine_chunks()
    return vector.values.to_numpy(zero_copy_only=False).reshape(-1, vector.type.list_size)


def as_float32(values: np.ndarray, dtype: StoreDtype) -> np.ndarray:
    """Stored values of `dtype` as the float32 numbers they stand for."""
    return bfloat16_values(values) if dtype == "bfloat16" else values.astype(np.float32, copy=False)


def decode_vectors(table: pa.Table, column: str = "vector") -> np.ndarray:
    """A vector column as float32 [N, d], whatever dtype it is stored in."""
    return as_float32(stored_values(table, column), vector_dtype(table, column))


def encode_vectors(table: pa.Table, store_dtype: StoreDtype, where: str = "", column: str = "vector") -> pa.Table:
    """The same table with the vectors of `column` stored as `store_dtype` (a PooledTable's "vector", an
    ITIHeadTable's "pooled") in one chunk; a value float16 cannot hold stops here, naming its layer, strategy (and
    head). Chunk by chunk into one output buffer, checked in the same pass: no float32 copy of the column beside
    the table (a job's builders leave it in a chunk a batch), so a 16-bit layer costs its writer half its float32
    bytes while encoded."""
    if vector_dtype(table, column) == store_dtype:
        return table
    dim = table.schema.field(column).type.list_size
    out = np.empty(table.num_rows * dim, dtype=_NUMPY_VALUES[store_dtype])
    for offset, X in _float32_chunks(table, column):
        if store_dtype == "float16":
            _stop_over_float16(table, offset, X, where)
        out[offset * dim:(offset + len(X)) * dim] = (bfloat16_bits(X) if store_dtype == "bfloat16" else X).reshape(-1)
    values = pa.FixedSizeListArray.from_arrays(pa.array(out, _ARROW_VALUES[store_dtype]), dim)
    return table.set_column(table.schema.get_field_index(column), _vector_field(dim, store_dtype, column), values)


def chunk_values(chunk: pa.FixedSizeListArray) -> np.ndarray:
    """One chunk of a vector column as its stored values [n, d], no copy (`flatten` honours a slice's offset)."""
    return chunk.flatten().to_numpy(zero_copy_only=False).reshape(-1, chunk.type.list_size)


def _float32_chunks(table: pa.Table, column: str) -> Iterator[tuple[int, np.ndarray]]:
    """Each chunk of a vector column as float32 [n, d] (no copy where stored at float32) with the table row it
    starts at."""
    dtype, offset = vector_dtype(table, column), 0
    for chunk in table.column(column).chunks:
        yield offset, as_float32(chunk_values(chunk), dtype)
        offset += len(chunk)


def check_float16(table: pa.Table, store_dtype: StoreDtype, where: str = "", column: str = "vector") -> None:
    """Stop, naming the row's layer, strategy (and head), where a vector of `column` holds a value float16 cannot:
    chunk by chunk, a block of rows at a time, so no copy of the column. Nothing to check for other dtypes."""
    if store_dtype != "float16" or vector_dtype(table, column) == "float16":
        return
    for offset, X in _float32_chunks(table, column):
        _stop_over_float16(table, offset, X, where)


def _stop_over_float16(table: pa.Table, offset: int, X: np.ndarray, where: str) -> None:
    """Raise for the first row of the chunk X (the table's rows from `offset`) that float16 cannot hold."""
    row = _first_row_over(X, _FLOAT16_MAX)
    if row is None:
        return
    at = offset + row
    head = f" head {table.column('head')[at]}" if "head" in table.column_names else ""
    raise StoreError(f"{where}layer {table.column('layer')[at]} {table.column('strategy')[at]}{head}: pooled value "
                     f"{float(np.abs(X[row]).max()):.6g} exceeds float16's {_FLOAT16_MAX:.0f}; "
                     "use --store-dtype bfloat16 or float32")


def _first_row_over(X: np.ndarray, limit: float) -> int | None:
    """The first row of X [N, d] holding a value beyond +-limit, None where none does; a block of rows at a time,
    so no temporary of X's size."""
    step = max(1, _BLOCK // max(X.shape[1], 1))
    for start in range(0, X.shape[0], step):
        bad = np.abs(X[start:start + step]) > limit
        if bad.any():
            return start + int(np.flatnonzero(bad.any(axis=1))[0])
    return None


class PooledTableBuilder:
    """Accumulates pooled batches (vectors [L, S, B, d]) and emits one Arrow table per layer (or per concept).

    Rows come out strategy by strategy, each strategy's passages in the order they were added, so a table does
    not depend on how its passages were cut into chunks (alone, or sharing forwards with other concepts)."""

    def __init__(self, passages: Sequence[Passage], hidden_size: int) -> None:
        self._by_id = {p.id: p for p in passages}
        self._hidden_size = hidden_size
        self._chunks: dict[int, dict[str, list[pa.RecordBatch]]] = {}

    def add(
        self,
        vectors: np.ndarray,
        layers: Sequence[int],
        strategy_ids: Sequence[str],
        passage_ids: Sequence[str],
        fallback: np.ndarray,
        rows: np.ndarray | None = None,
        *,
        copy: bool = True,
    ) -> None:
        """Add one pooled batch (vectors [L, S, B', d] of which `rows` are these passages', all where None;
        fallback [S, B]). Each layer's vectors are copied into a buffer of their own: a pooler's arrays are views of a
        host buffer that later chunks reuse, and a layer's table that owns its memory is freed once it is written,
        not when the job's last layer is (ExtractorWorker._store). `copy=False` keeps views of `vectors` (a job's
        last chunk, whose buffer no later chunk takes: DevicePooler.hand_over)."""
        n_strategies, batch = len(strategy_ids), len(passage_ids)
        dim = vectors.shape[-1]
        passages = [self._by_id[pid] for pid in passage_ids]
        schema = pooled_schema(self._hidden_size)
        columns = {
            "passage_id": pa.array([p.id for p in passages] * n_strategies, pa.string()),
            "label": pa.array(np.tile([p.label for p in passages], n_strategies).astype(np.int8)),
            "split": pa.array([p.split for p in passages] * n_strategies, pa.string()),
            "group": pa.array([p.group for p in passages] * n_strategies, pa.string()),
            "strategy": pa.array(np.repeat(np.asarray(strategy_ids, dtype=object), batch), pa.string()),
            "fallback": pa.array(np.asarray(fallback, dtype=bool).reshape(-1)),
        }
        for i, layer in enumerate(layers):
            own = (np.array if copy else np.asarray)(vectors[i], dtype=np.float32) if rows is None else \
                np.take(vectors[i], rows, axis=1).astype(np.float32, copy=False)
            record = pa.RecordBatch.from_pydict({
                **columns, "layer": pa.array(np.full(n_strategies * batch, layer, dtype=np.int16)),
                "vector": pa.FixedSizeListArray.from_arrays(pa.array(own.reshape(-1), pa.float32()), dim)},
                schema=schema)
            per_strategy = self._chunks.setdefault(int(layer), {})
            for s, strategy in enumerate(strategy_ids):
                per_strategy.setdefault(strategy, []).append(record.slice(s * batch, batch))

    def _batches(self, layer: int) -> list[pa.RecordBatch]:
        return [chunk for chunks in self._chunks[layer].values() for chunk in chunks]

    def layer_tables(self, metadata: dict[str, str] | None = None) -> dict[int, pa.Table]:
        """One float32 table per layer, in the order layers were first added."""
        schema = pooled_schema(self._hidden_size).with_metadata(metadata or {})
        return {layer: pa.Table.from_batches(self._batches(layer), schema=schema) for layer in self._chunks}

    def table(self, metadata: dict[str, str] | None = None) -> pa.Table:
        """Every layer in one table (rows layer by layer), for callers that keep vectors in memory."""
        schema = pooled_schema(self._hidden_size).with_metadata(metadata or {})
        return pa.Table.from_batches([c for layer in self._chunks for c in self._batches(layer)], schema=schema)


@dataclass
class PooledMatrix:
    """The rows of one (layer, strategy) cell as arrays, ready for a probe."""

    passage_ids: np.ndarray
    X: np.ndarray  # [N, d] float32
    y: np.ndarray  # [N] int
    groups: np.ndarray  # [N] str
    split: np.ndarray  # [N] str
    fallback: np.ndarray  # [N] bool

    def subset(self, split: str) -> PooledMatrix:
        return self.take(np.flatnonzero(self.split == split))

    def take(self, rows: np.ndarray) -> PooledMatrix:
        return PooledMatrix(self.passage_ids[rows], self.X[rows], self.y[rows], self.groups[rows],
                            self.split[rows], self.fallback[rows])


class PooledTableView:
    """Decodes a PooledTable once and hands out per-cell matrices by (layer, strategy)."""

    def __init__(self, table: pa.Table) -> None:
        # Kept as stored and decoded per cell: a 16-bit shard never sits in memory at 32 bits whole.
        self._values, self._dtype = stored_values(table), vector_dtype(table)
        self._cols = {name: table.column(name).to_numpy(zero_copy_only=False)
                      for name in ("passage_id", "label", "split", "group", "layer", "strategy", "fallback")}
        keys = np.char.add(self._cols["layer"].astype(str), np.char.add("|", self._cols["strategy"].astype(str)))
        order = np.argsort(keys, kind="stable")
        uniq, starts = np.unique(keys[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        self._index = {k: order[s:e] for k, s, e in zip(uniq.tolist(), starts, ends, strict=True)}

    @property
    def cells(self) -> list[tuple[int, str]]:
        out = []
        for key in self._index:
            layer, strategy = key.split("|", 1)
            out.append((int(layer), strategy))
        return sorted(out)

    def matrix(self, layer: int, strategy: str) -> PooledMatrix:
        rows = self._index[f"{layer}|{strategy}"]
        c = self._cols
        X = as_float32(self._values[rows], self._dtype)
        return PooledMatrix(c["passage_id"][rows], X, c["label"][rows].astype(int), c["group"][rows],
                            c["split"][rows], c["fallback"][rows])


def write_pooled_manifest(store: ArtifactStore, key: str, layers: Sequence[int], store_dtype: StoreDtype) -> None:
    """Mark a concept pooled, last: only when every layer's shard is stored, so a killed run is resumable."""
    missing = [layer for layer in layers if not store.exists(layer_shard_key(key, layer))]
    if missing:
        raise StoreError(f"{key}: layer shards {missing} are not stored; the concept is not pooled")
    store.put_json(key, {"format": MANIFEST_FORMAT, "layers": [int(layer) for layer in layers],
                         "store_dtype": store_dtype,
                         "shards": {str(layer): layer_shard_key(key, layer) for layer in layers}})


def pooled_layers(store: ArtifactStore, key: str) -> list[int]:
    """The layers a stored concept was pooled at, from its manifest."""
    manifest = store.get_json(key)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise StoreError(f"{key}: not a sharded PooledTable manifest ({MANIFEST_FORMAT})")
    return [int(layer) for layer in manifest["layers"]]


def read_pooled_layer(store: ArtifactStore, key: str, layer: int) -> pa.Table:
    """One layer's shard of the concept stored under `key`: what a D1 task or a steering cell needs."""
    return store.get_table(layer_shard_key(key, layer))


def stored_layers(store: ArtifactStore, key: str) -> list[int]:
    """The layers stored under `key`, sharded (its manifest) or in the one table written before sharding."""
    if holds_one_table(store, key):
        return sorted(int(v) for v in pc.unique(store.get_table(key).column("layer")).to_pylist())
    return pooled_layers(store, key)


def read_pooled_table(store: ArtifactStore, key: str, layers: Sequence[int] | None = None) -> pa.Table:
    """The concept's shards (every layer, or `layers`) as one table, for readers that span layers; a key that
    holds one whole table (stores written before sharding, POOL_VERSION < 3) is read as it is."""
    if holds_one_table(store, key):
        table = store.get_table(key)
        return table if layers is None else table.filter(pc.is_in(table.column("layer"), pa.array(list(layers))))
    chosen = pooled_layers(store, key) if layers is None else list(layers)
    tables = [read_pooled_layer(store, key, layer) for layer in chosen]
    if not tables:
        raise StoreError(f"{key}: no layers to read")
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def holds_one_table(store: ArtifactStore, key: str) -> bool:
    """True when `key` holds something other than a manifest: the one table of the unsharded layout."""
    try:
        store.get_json(key)
    except StoreError:
        return store.exists(key)
    return False
