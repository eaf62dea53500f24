"""Pool one concept's passages on the fly: token activations live for one batch, pooled vectors are kept."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.extract import extract_activations
from poolbench.extractor.loading import LoadedModel
from poolbench.passage import Passage
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.pooler.spec import StrategySpec

POOL_VERSION = 1  # bump when extraction or pooling changes what a stored PooledTable holds


def pool_concept(
    loaded: LoadedModel,
    passages: Sequence[Passage],
    layers: Sequence[int],
    specs: Sequence[StrategySpec],
    *,
    batch_size: int = 32,
    max_length: int = 256,
    metadata: dict[str, str] | None = None,
    on_batch: Callable[[ActivationBatch], None] | None = None,
) -> pa.Table:
    """Extract every requested layer in one forward per batch and pool all strategies right away."""
    builder = PooledTableBuilder(passages, loaded.hidden_size)
    for batch in extract_activations(loaded.model, loaded.tokenizer, loaded.decoder_layers, passages, layers,
                                     batch_size=batch_size, max_length=max_length):
        if on_batch is not None:
            on_batch(batch)
        pooled = pool_tokens(batch, specs)
        builder.add(pooled.vectors, pooled.layers, pooled.strategy_ids, pooled.passage_ids, pooled.fallback)
    return builder.table(metadata)
