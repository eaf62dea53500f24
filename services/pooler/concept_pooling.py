"""Pool one concept's passages on the fly: token activations live for one batch, pooled vectors are kept.

The extractor computes only what the requested strategies need (attention inflow, gradients); parses and the
concept's train-split statistics are prepared once per concept and handed to every batch as extras.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import Passage
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.extract import ExtractionStats, PaddedBatch, capture_chunks, prepare_batches
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.concept_context import ConceptContext
from poolbench.pooler.device_pool import DevicePooler, HostPooler, chunk_pooler
from poolbench.pooler.iti import FRACTION_META, HEADS_META, ITIHeadTableBuilder
from poolbench.pooler.parses import ParseIndex, batch_parse_extras, load_nlp, parse_table
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.pooler.saliency import check_encoder_support, remove_first_component
from poolbench.pooler.spec import StrategySpec

POOL_VERSION = 3  # bump when extraction or pooling changes what a stored PooledTable holds; 2: ITIHeadTable;
# 3: one shard per (concept, layer) under a manifest, vectors optionally stored at 16 bits


@dataclass(frozen=True)
class PooledConcept:
    """A concept's PooledTable per layer (real strategies only) and, per layer, the ITIHeadTable of its
    supervised strategies: the store keeps one shard per layer, so a reader of one layer loads only it."""

    layers: dict[int, pa.Table]
    layer_heads: dict[int, pa.Table] | None  # None when no requested strategy is supervised
    skipped: tuple[tuple[str, int], ...] = ()  # (passage id, tokens) that did not fit the device alone

    @property
    def pooled(self) -> pa.Table:
        """Every layer in one table, for in-memory callers (HTTP /pool, steering vectors in tests)."""
        return pa.concat_tables(list(self.layers.values()))

    @property
    def heads(self) -> pa.Table | None:
        """Every layer's ITIHeadTable in one table, or None without a supervised strategy."""
        return pa.concat_tables(list(self.layer_heads.values())) if self.layer_heads is not None else None


def strategy_needs(specs: Sequence[StrategySpec]) -> frozenset[str]:
    """The union of the specs' needs: what extraction and preparation must provide."""
    return frozenset().union(*(spec.needs for spec in specs)) if specs else frozenset()


def pool_concept(loaded: LoadedModel, passages: Sequence[Passage], layers: Sequence[int],
                 specs: Sequence[StrategySpec], *, batch_size: int = 32, max_length: int = 256,
                 metadata: dict[str, str] | None = None, parses: ParseIndex | None = None,
                 max_batch_tokens: int | None = None, device_pooling: bool = True) -> pa.Table:
    """The PooledTable alone, for callers that never probe a supervised strategy (steering vectors): probing
    an S3 cell without its ITIHeadTable stops with an error."""
    return pool_concept_tables(loaded, passages, layers, specs, batch_size=batch_size, max_length=max_length,
                               metadata=metadata, parses=parses, max_batch_tokens=max_batch_tokens,
                               device_pooling=device_pooling).pooled


def pool_concept_tables(
    loaded: LoadedModel,
    passages: Sequence[Passage],
    layers: Sequence[int],
    specs: Sequence[StrategySpec],
    *,
    batch_size: int = 32,
    max_length: int = 256,
    metadata: dict[str, str] | None = None,
    on_batch: Callable[[PaddedBatch | ActivationBatch], None] | None = None,
    parses: ParseIndex | None = None,
    max_batch_tokens: int | None = None,
    device_pooling: bool = True,
    keep_activations: bool = False,
    stats: ExtractionStats | None = None,
) -> PooledConcept:
    """Extract every requested layer in one forward per batch and pool all strategies inside that forward.

    Pooling runs on the model's device in the capture (device_pool.DevicePooler): only pooled vectors leave it.
    `device_pooling=False` or `keep_activations=True` (on_batch then gets each chunk's ActivationBatch, e.g. for
    activation dumps) pool the reference way, token states to the host and numpy `pool_tokens`; otherwise
    on_batch gets the PaddedBatch. `parses` (e.g. the cached artifact) serves strategies that need them;
    without it they are parsed here. `max_batch_tokens` bounds each forward (None: from free memory); the table
    is the same whatever it is. Passages that do not fit the device alone are left out, in `skipped`."""
    specs = list(specs)
    needs = strategy_needs(specs)
    check_encoder_support(loaded.kind, specs)
    batches = prepare_batches(loaded.tokenizer, passages, batch_size=batch_size, max_length=max_length)
    if "parse" in needs and parses is None:
        texts, ids = [p.text for p in passages], [p.id for p in passages]
        parses = ParseIndex.from_table(parse_table(load_nlp(), texts, ids))
    context = None
    if "corpus" in needs:
        context = _fit_context(passages, batches, parses)
    builder = PooledTableBuilder(passages, loaded.hidden_size)
    heads = {int(layer): ITIHeadTableBuilder(loaded.hidden_size) for layer in layers}
    metadata = dict(metadata or {})
    head_metadata = dict(metadata)
    stats = stats if stats is not None else ExtractionStats()
    device = None if keep_activations or not device_pooling else next(loaded.model.parameters()).device

    def host_extras(chunk: PaddedBatch) -> dict[str, np.ndarray]:
        """What the strategies read from the text, built on the CPU before the chunk's forward."""
        extras: dict[str, np.ndarray] = {}
        if "parse" in needs:
            extras.update(batch_parse_extras(parses, chunk.passage_ids, chunk.texts, chunk.offsets,
                                             chunk.attention_mask,
                                             context.word_flags if context is not None else None))
        if context is not None:
            extras["unigram_probability"] = context.unigram_probability(chunk.input_ids)
        return extras

    def sink_for(chunk: PaddedBatch) -> DevicePooler | HostPooler:
        return chunk_pooler(specs, chunk, layers, host_extras(chunk), device)

    for chunk, pooler in capture_chunks(loaded.model, loaded.decoder_layers, batches, layers, sink_for=sink_for,
                                        needs=needs, max_batch_tokens=max_batch_tokens, stats=stats):
        if on_batch is not None:
            on_batch(pooler.activations if pooler.activations is not None else chunk)
        pooled = pooler.pooled
        assert pooled is not None
        builder.add(pooled.vectors, pooled.layers, pooled.strategy_ids, pooled.passage_ids, pooled.fallback)
        for spec in specs:
            if spec.supervision == "labels":
                assert pooler.heads is not None
                per_head, outputs = pooler.heads
                metadata[f"{spec.id}{HEADS_META}"] = str(per_head.shape[2])
                head_metadata[f"{spec.id}{FRACTION_META}"] = str(spec.param("head_fraction"))
                for i, layer in enumerate(pooled.layers):
                    heads[int(layer)].add(spec.id, [layer], pooled.passage_ids, per_head[i:i + 1],
                                          outputs[i:i + 1])
        stats.pool_seconds += pooler.pool_seconds
        stats.transfer_seconds += pooler.transfer_seconds
    tables = builder.layer_tables(metadata)
    for spec in specs:
        if dict(spec.params).get("remove_first_pc") is True:
            tables = {layer: _remove_first_pc(table, spec.id) for layer, table in tables.items()}
    supervised = any(spec.supervision == "labels" for spec in specs)
    return PooledConcept(tables, {layer: heads[layer].table(head_metadata) for layer in tables}
                         if supervised else None, tuple(stats.skipped))


def _fit_context(passages: Sequence[Passage], batches, parses: ParseIndex | None) -> ConceptContext:
    """Train-split statistics: TF-IDF over parsed words, unigram counts over non-special model tokens."""
    train = {p.id for p in passages if p.split == "train"}
    token_ids = []
    for batch in batches:
        for row, passage_id in enumerate(batch.passage_ids):
            if passage_id in train:
                keep = batch.attention_mask[row] & ~batch.special_mask[row]
                token_ids.append(batch.input_ids[row][keep].tolist())
    concept = passages[0].concept if passages else ""
    context = ConceptContext.fit(concept, parses, [p.id for p in passages if p.split == "train"], token_ids)
    if parses is not None:
        context.cache_keywords(parses, [p.id for p in passages])
    return context


def _remove_first_pc(table: pa.Table, strategy_id: str) -> pa.Table:
    """SIF's common-component removal per layer, the component fitted on the strategy's train rows only."""
    vector = table.column("vector").combine_chunks()
    dim = vector.type.list_size
    X = vector.values.to_numpy(zero_copy_only=False).reshape(-1, dim).copy()
    strategy = table.column("strategy").to_numpy(zero_copy_only=False)
    layer = table.column("layer").to_numpy(zero_copy_only=False)
    train = table.column("split").to_numpy(zero_copy_only=False) == "train"
    for value in np.unique(layer):
        rows = np.flatnonzero((strategy == strategy_id) & (layer == value))
        X[rows] = remove_first_component(X[rows], train[rows])
    column = pa.FixedSizeListArray.from_arrays(pa.array(X.reshape(-1), pa.float32()), dim)
    return table.set_column(table.schema.get_field_index("vector"), table.schema.field("vector"), column)
