"""PooledTable: the durable Arrow form of pooled vectors, one row per (passage, layer, strategy).

Real strategies only: S3's per-head pooled vectors and head outputs live in its ITIHeadTable (poolbench.pooler.iti)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import Passage


def pooled_schema(hidden_size: int) -> pa.Schema:
    """Vectors are fixed-size float32 lists so a whole column converts to one [N, d] array without copies."""
    return pa.schema(
        [
            pa.field("passage_id", pa.string()),
            pa.field("label", pa.int8()),
            pa.field("split", pa.string()),
            pa.field("group", pa.string()),
            pa.field("layer", pa.int16()),
            pa.field("strategy", pa.string()),
            pa.field("fallback", pa.bool_()),
            pa.field("vector", pa.list_(pa.float32(), hidden_size)),
        ]
    )


class PooledTableBuilder:
    """Accumulates pooled batches (vectors [L, S, B, d]) and emits one Arrow table per concept."""

    def __init__(self, passages: Sequence[Passage], hidden_size: int) -> None:
        self._by_id = {p.id: p for p in passages}
        self._hidden_size = hidden_size
        self._chunks: list[pa.RecordBatch] = []

    def add(
        self,
        vectors: np.ndarray,
        layers: Sequence[int],
        strategy_ids: Sequence[str],
        passage_ids: Sequence[str],
        fallback: np.ndarray,
    ) -> None:
        """Add one pooled batch; rows are ordered layer-major, then strategy, then passage."""
        n_layers, n_strategies, batch, dim = vectors.shape
        passages = [self._by_id[pid] for pid in passage_ids]
        rows = n_layers * n_strategies * batch
        flat = np.ascontiguousarray(vectors, dtype=np.float32).reshape(rows * dim)
        tile = n_layers * n_strategies
        columns = {
            "passage_id": pa.array([p.id for p in passages] * tile, pa.string()),
            "label": pa.array(np.tile([p.label for p in passages], tile).astype(np.int8)),
            "split": pa.array([p.split for p in passages] * tile, pa.string()),
            "group": pa.array([p.group for p in passages] * tile, pa.string()),
            "layer": pa.array(np.repeat(np.asarray(layers, dtype=np.int16), n_strategies * batch)),
            "strategy": pa.array(np.tile(np.repeat(np.asarray(strategy_ids, dtype=object), batch), n_layers),
                                 pa.string()),
            "fallback": pa.array(np.tile(np.asarray(fallback, dtype=bool).reshape(-1), n_layers)),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), dim),
        }
        self._chunks.append(pa.RecordBatch.from_pydict(columns, schema=pooled_schema(self._hidden_size)))

    def table(self, metadata: dict[str, str] | None = None) -> pa.Table:
        schema = pooled_schema(self._hidden_size).with_metadata(metadata or {})
        return pa.Table.from_batches(self._chunks, schema=schema)


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
        vector = table.column("vector").combine_chunks()
        dim = vector.type.list_size
        self._X = vector.values.to_numpy(zero_copy_only=False).reshape(-1, dim)
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
        return PooledMatrix(c["passage_id"][rows], self._X[rows], c["label"][rows].astype(int),
                            c["group"][rows], c["split"][rows], c["fallback"][rows])
