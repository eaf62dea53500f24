"""S3_iti_probe, supervised: pooling weights from the attention heads that best predict the concept.

Per layer and head h: the feature of a passage is the head's output at the last real token (its
attention-weighted sum of values, before o_proj, as in inference-time intervention), one logistic probe per
head is cross-validated on it, and the top heads (a fraction of the model's heads, default 25%, at least one)
give the token weights: the mean of their per-head-normalised attention inflow. Because each head's weights
sum to 1, the pooled vector is the mean of the chosen heads' per-head pooled vectors, so pooling stores every
head's pooled vector and output in an ITIHeadTable beside the PooledTable, and the prober picks heads inside
each D1 fold on that fold's training part only (poolbench.prober.supervised). The PooledTable's
"S3_iti_probe" row holds the all-heads mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch

from poolbench.errors import StoreError
from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.pooled_table import (
    StoreDtype,
    decode_vectors,
    encode_vectors,
    holds_one_table,
    pooled_layers,
)
from poolbench.pooler.saliency import attention_inflow_weights
from poolbench.pooler.spec import StrategySpec
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key, layer_shard_key

HEAD_FRACTION = 0.25
HEADS_META = ":heads"  # PooledTable metadata "<strategy>:heads" = head count: its ITIHeadTable must come along
FRACTION_META = ":head_fraction"  # ITIHeadTable metadata "<strategy>:head_fraction"


def head_table_key(pooled_key: str) -> str:
    """The ITIHeadTable artifact that belongs to the PooledTable stored under `pooled_key`."""
    return artifact_key("iti_heads", pooled=pooled_key)


def read_head_table(store: ArtifactStore, key: str, layers: Sequence[int] | None = None) -> pa.Table:
    """S3's ITIHeadTable for the concept under `key`, its layer shards' head tables joined (or the one table of
    the unsharded layout), for readers that span layers as power and flash-check do."""
    if layers is None and holds_one_table(store, key):
        return store.get_table(head_table_key(key))
    chosen = pooled_layers(store, key) if layers is None else list(layers)
    tables = [store.get_table(head_table_key(layer_shard_key(key, layer))) for layer in chosen]
    if not tables:
        raise StoreError(f"{key}: no layers to read")
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def head_vectors(batch: ActivationBatch) -> tuple[np.ndarray, np.ndarray]:
    """Per-head pooled vectors [L, B, H, d] (each head's normalised inflow as token weights) and per-head
    last-token outputs [L, B, H, Dh] of one batch."""
    inflow = np.asarray(batch.extras["attention_head_inflow"], dtype=np.float32)  # [L, B, H, T]
    outputs = np.asarray(batch.extras["attention_head_output_last"], dtype=np.float32)  # [L, B, H, Dh]
    weights = np.where(batch.attention_mask[None, :, None, :], inflow, 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.where(total > 0, weights / np.where(total > 0, total, 1), 0.0).astype(np.float32)
    pooled = torch.matmul(torch.from_numpy(weights), torch.from_numpy(batch.hidden))  # [L, B, H, d]
    return pooled.numpy(), outputs


def iti_head_schema(hidden_size: int, head_dim: int) -> pa.Schema:
    """One row per (passage, layer, strategy, head): the head's pooled vector [d] and its own output [Dh]."""
    return pa.schema(
        [
            pa.field("passage_id", pa.string()),
            pa.field("layer", pa.int16()),
            pa.field("strategy", pa.string()),
            pa.field("head", pa.int16()),
            pa.field("pooled", pa.list_(pa.float32(), hidden_size)),
            pa.field("output", pa.list_(pa.float32(), head_dim)),
        ]
    )


def encode_head_table(table: pa.Table, store_dtype: StoreDtype, where: str = "") -> pa.Table:
    """An ITIHeadTable with its heads' pooled vectors stored as `store_dtype`, as the PooledTable's are: at d 4,096
    they are 32 pooled vectors a passage and layer, most of a concept's bytes. Each head's own output stays float32
    (1/32 of those bytes): the per-head probes that choose the heads read it."""
    return encode_vectors(table, store_dtype, where, column="pooled")


def selects_heads(spec: StrategySpec) -> bool:
    """True for a supervised strategy of S3's kind (per-head pooled vectors from attention), not a learned one."""
    return spec.supervision == "labels" and "attention" in spec.needs


def needs_head_table(pooled: pa.Table) -> bool:
    """True when the PooledTable holds a supervised strategy whose per-head vectors live in an ITIHeadTable."""
    return any(key.decode().endswith(HEADS_META) for key in (pooled.schema.metadata or {}))


class ITIHeadTableBuilder:
    """Accumulates per-head batches of supervised strategies and emits one ITIHeadTable per concept, strategy by
    strategy, so the table does not depend on how its passages were cut into chunks."""

    def __init__(self, hidden_size: int) -> None:
        self._hidden_size = hidden_size
        self._head_dim = 0
        self._chunks: dict[str, list[pa.RecordBatch]] = {}

    def add(self, strategy_id: str, layers: Sequence[int], passage_ids: Sequence[str], pooled: np.ndarray,
            outputs: np.ndarray) -> None:
        """Add one batch (pooled [L, B, H, d], outputs [L, B, H, Dh]); rows are layer, passage, then head."""
        n_layers, batch, n_heads, dim = pooled.shape
        self._head_dim = outputs.shape[-1]
        rows = n_layers * batch * n_heads
        columns = {
            "passage_id": pa.array(np.tile(np.repeat(np.asarray(passage_ids, dtype=object), n_heads), n_layers),
                                   pa.string()),
            "layer": pa.array(np.repeat(np.asarray(layers, dtype=np.int16), batch * n_heads)),
            "strategy": pa.array([strategy_id] * rows, pa.string()),
            "head": pa.array(np.tile(np.arange(n_heads, dtype=np.int16), n_layers * batch)),
            "pooled": _fixed_size(pooled, dim),
            "output": _fixed_size(outputs, self._head_dim),
        }
        schema = iti_head_schema(self._hidden_size, self._head_dim)
        self._chunks.setdefault(strategy_id, []).append(pa.RecordBatch.from_pydict(columns, schema=schema))

    def table(self, metadata: dict[str, str] | None = None) -> pa.Table:
        schema = iti_head_schema(self._hidden_size, self._head_dim).with_metadata(metadata or {})
        return pa.Table.from_batches([c for chunks in self._chunks.values() for c in chunks], schema=schema)


def _fixed_size(values: np.ndarray, width: int) -> pa.FixedSizeListArray:
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), width)


class ITIHeadView:
    """Decodes an ITIHeadTable once and hands out one (layer, strategy) cell's heads in a given passage order."""

    def __init__(self, table: pa.Table) -> None:
        self._pooled = decode_vectors(table, "pooled")  # float32, or the run's 16-bit store dtype
        self._outputs = decode_vectors(table, "output")
        self._cols = {name: table.column(name).to_numpy(zero_copy_only=False)
                      for name in ("passage_id", "layer", "strategy", "head")}
        self._metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}

    def head_fraction(self, strategy: str) -> float:
        return float(self._metadata.get(f"{strategy}{FRACTION_META}", HEAD_FRACTION))

    def cell(self, layer: int, strategy: str, passage_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pooled [H, N, d], outputs [N, H, Dh]) float32, rows in the order of `passage_ids`."""
        c = self._cols
        rows = np.flatnonzero((c["layer"] == layer) & (c["strategy"] == strategy))
        position = {pid: i for i, pid in enumerate(passage_ids)}
        place = np.array([position.get(pid, -1) for pid in c["passage_id"][rows]], dtype=np.int64)
        heads = c["head"][rows].astype(np.int64)
        n, n_heads = len(passage_ids), (int(heads.max()) + 1 if rows.size else 0)
        order = np.lexsort((heads, place))
        if (rows.size != n * n_heads or n_heads == 0
                or not np.array_equal(place[order], np.repeat(np.arange(n), n_heads))
                or not np.array_equal(heads[order], np.tile(np.arange(n_heads), n))):
            raise StoreError(f"ITIHeadTable: {strategy} layer {layer} does not hold every head of every passage "
                             "of its PooledTable")
        rows = rows[order]
        pooled = self._pooled[rows].reshape(n, n_heads, -1).transpose(1, 0, 2)
        return pooled, self._outputs[rows].reshape(n, n_heads, -1)


SPECS = (
    StrategySpec(
        id="S3_iti_probe", code="S3", family="saliency_weighted", kind="weights",
        weights_fn=attention_inflow_weights, needs=frozenset({"attention", "labels"}), supervision="labels",
        params=(("head_fraction", HEAD_FRACTION),),
        description="Attention inflow of the heads whose last-token outputs best predict the concept "
                    "(top 25% of heads by CV AUROC, chosen inside each D1 fold on its training part).",
    ),
)
