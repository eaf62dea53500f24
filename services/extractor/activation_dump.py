"""Token-level activations as Arrow (float16), only for users who ask with --dump-activations."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from poolbench.extractor.activations import ActivationBatch


def activation_dump_schema(hidden_size: int) -> pa.Schema:
    return pa.schema([
        pa.field("passage_id", pa.string()),
        pa.field("layer", pa.int16()),
        pa.field("token_index", pa.int32()),
        pa.field("token_id", pa.int64()),
        pa.field("char_start", pa.int32()),
        pa.field("char_end", pa.int32()),
        pa.field("vector", pa.list_(pa.float16(), hidden_size)),
    ])


def activation_dump_table(batch: ActivationBatch) -> pa.Table:
    """One row per (layer, real token); padding is dropped so the dump holds only what the model saw."""
    n_layers, _, _, dim = batch.hidden.shape
    b_idx, t_idx = np.nonzero(batch.attention_mask)
    # Token index within the passage counts real tokens only, whatever the padding side.
    token_index = (np.cumsum(batch.attention_mask, axis=1) - 1)[b_idx, t_idx]
    ids = np.asarray(batch.passage_ids, dtype=object)[b_idx]
    vectors = batch.hidden[:, b_idx, t_idx, :].astype(np.float16)  # [L, N, d]
    n_tokens = len(b_idx)
    columns = {
        "passage_id": pa.array(np.tile(ids, n_layers), pa.string()),
        "layer": pa.array(np.repeat(np.asarray(batch.layers, dtype=np.int16), n_tokens)),
        "token_index": pa.array(np.tile(token_index.astype(np.int32), n_layers)),
        "token_id": pa.array(np.tile(batch.input_ids[b_idx, t_idx], n_layers)),
        "char_start": pa.array(np.tile(batch.offsets[b_idx, t_idx, 0].astype(np.int32), n_layers)),
        "char_end": pa.array(np.tile(batch.offsets[b_idx, t_idx, 1].astype(np.int32), n_layers)),
        "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float16()), dim),
    }
    return pa.Table.from_pydict(columns, schema=activation_dump_schema(dim))
