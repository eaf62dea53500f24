"""What S2's backward leaves for steerability: per passage and layer, G_L(x) = sum_t d log p(x) / d h_{L,t} over
the passage's real tokens, and the sum and count of ||h_{L,t}|| over the tokens alpha's unit is measured on.

The extractor's gradient pass (gradient_saliency.gradient_forward) hands "gradient_sum" [B, d] beside S2's token
weights; `GradientTee` wraps a chunk's pooling sink, keeps that and the norm sums, and passes everything else on
unchanged, so the pooled vectors are what they were. The table is stored beside each PooledTable shard
(`gradient_table_key`); a shard pooled without S2 has none, and its cells have no first-order steerability.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import torch

from poolbench.errors import StoreError
from poolbench.extractor.layer_sinks import LaunchedSink, LayerExtras, LayerSink
from poolbench.extractor.padded_batches import PaddedBatch, host_to_device
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key, layer_shard_key

GRADIENT_SUM = "gradient_sum"


def gradient_table_key(shard_key: str) -> str:
    """The gradient-sum table that belongs to the PooledTable shard stored under `shard_key`."""
    return artifact_key("gradient_sums", pooled=shard_key)


def gradient_schema(hidden_size: int) -> pa.Schema:
    return pa.schema([("passage_id", pa.string()), ("layer", pa.int32()),
                      ("gradient_sum", pa.list_(pa.float32(), hidden_size)),
                      ("norm_sum", pa.float64()), ("norm_count", pa.int32())])


def norm_mask(chunk: PaddedBatch) -> np.ndarray:
    """[B, T] the tokens alpha's unit is measured on (measures.mean_residual_norms): real, not special, and not
    each passage's first real token."""
    mask = np.asarray(chunk.attention_mask, dtype=bool)
    keep = mask & ~np.asarray(chunk.special_mask, dtype=bool)
    first = mask.argmax(axis=1)
    keep[np.arange(len(mask)), first] = False
    return keep


class GradientTee:
    """A capture sink around a chunk's pooling sink: takes each layer's "gradient_sum" and norm sums, hands the
    inner sink the rest. After `finish`: `layers`, `sums` [L, B, d], `norm_sums` [L, B], `norm_counts` [B]."""

    def __init__(self, inner: LayerSink, chunk: PaddedBatch) -> None:
        self.inner = inner
        self.chunk = chunk
        self._keep = norm_mask(chunk)
        self._keep_device: torch.Tensor | None = None
        self._taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layers: tuple[int, ...] = ()
        self.sums: np.ndarray | None = None
        self.norm_sums: np.ndarray | None = None
        self.norm_counts = self._keep.sum(axis=1).astype(np.int32)
        self._host: tuple[torch.Tensor, torch.Tensor] | None = None  # the sums on the host, once launched
        self._event: torch.cuda.Event | None = None  # their copies' end, where the inner sink records none

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor, extras: LayerExtras) -> None:
        if GRADIENT_SUM in extras:
            if self._keep_device is None:
                # page-locked and non-blocking: a plain copy to a GPU waits for the device's queue, here inside the
                # backward that hands this layer over
                self._keep_device = host_to_device(self._keep, hidden.device)
            # reduced in float32 without a float32 copy of the states (a bfloat16 model's: 134 MB a layer at the 8B
            # shape's 16 x 512 tokens); the same values as the norm of that copy (tests/test_gradient_sums.py)
            norms = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32)
            self._taken[int(layer)] = (extras[GRADIENT_SUM].float(),
                                       torch.where(self._keep_device, norms, 0.0).double().sum(dim=1))
            extras = {name: value for name, value in extras.items() if name != GRADIENT_SUM}
        self.inner(layer, hidden, extras)

    def launched(self) -> bool:
        """The sums' copies to the host go behind the chunk's work (page-locked on CUDA, non-blocking), then the
        inner sink's own copies and event, so one wait in `finish` covers both (layer_sinks.LaunchedSink); False
        where the inner sink cannot be finished late."""
        self.layers = tuple(sorted(self._taken))
        pin = False
        if self.layers:
            sums = torch.stack([self._taken[layer][0] for layer in self.layers])
            norm_sums = torch.stack([self._taken[layer][1] for layer in self.layers])
            pin = sums.is_cuda
            self._host = (torch.empty(sums.shape, dtype=sums.dtype, pin_memory=pin).copy_(sums, non_blocking=pin),
                          torch.empty(norm_sums.shape, dtype=norm_sums.dtype, pin_memory=pin
                                      ).copy_(norm_sums, non_blocking=pin))
        self._taken = {}
        if isinstance(self.inner, LaunchedSink):
            # its event comes after the sums' copies: recorded on the compute stream behind them, or on the copy
            # stream after it waited for the compute stream (device_staging.DeviceStaging.send)
            return self.inner.launched()
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()
        return False

    def finish(self) -> None:
        if self._host is None and self._taken:
            self.launched()
        self.inner.finish()
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if self._host is not None:
            self.sums, self.norm_sums = self._host[0].numpy(), self._host[1].numpy()
            self._host = None


class GradientTableBuilder:
    """Rows of one concept's gradient tables, per layer, as chunks finish."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self._rows: dict[int, list[pa.RecordBatch]] = {}

    def add(self, tee: GradientTee, rows: np.ndarray | None) -> None:
        """The tee's passages (`rows` of its chunk, or all) at every layer it took."""
        if tee.sums is None or tee.norm_sums is None:
            return
        take = np.arange(len(tee.chunk.passage_ids)) if rows is None else np.asarray(rows)
        ids = [tee.chunk.passage_ids[int(r)] for r in take]
        for j, layer in enumerate(tee.layers):
            sums = np.ascontiguousarray(tee.sums[j][take], dtype=np.float32)
            self._rows.setdefault(layer, []).append(pa.RecordBatch.from_arrays(
                [pa.array(ids, pa.string()), pa.array(np.full(len(ids), layer, np.int32)),
                 pa.FixedSizeListArray.from_arrays(pa.array(sums.reshape(-1)), self.hidden_size),
                 pa.array(tee.norm_sums[j][take], pa.float64()), pa.array(tee.norm_counts[take], pa.int32())],
                schema=gradient_schema(self.hidden_size)))

    def layer_tables(self) -> dict[int, pa.Table]:
        return {layer: pa.Table.from_batches(batches) for layer, batches in sorted(self._rows.items())}


def gradient_arrays(table: pa.Table, passage_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G [N, d], norm sums [N], norm counts [N]) for `passage_ids`, in that order; one line naming a missing id."""
    index = {pid: i for i, pid in enumerate(table.column("passage_id").to_pylist())}
    missing = [pid for pid in passage_ids if pid not in index]
    if missing:
        raise StoreError(f"gradient table has no passage {missing[0]!r} ({len(missing)} missing)")
    rows = np.array([index[pid] for pid in passage_ids], dtype=np.int64)
    column = table.column("gradient_sum").combine_chunks()
    width = column.type.list_size
    G = column.values.to_numpy(zero_copy_only=False).reshape(-1, width)[rows]
    return (G, table.column("norm_sum").to_numpy()[rows], table.column("norm_count").to_numpy()[rows])


def read_gradient_table(store: ArtifactStore, pooled_key: str, layer: int) -> pa.Table | None:
    """The gradient sums stored beside `pooled_key`'s shard at `layer`, or None where it was pooled without S2."""
    key = gradient_table_key(layer_shard_key(pooled_key, layer))
    return store.get_table(key) if store.exists(key) else None
