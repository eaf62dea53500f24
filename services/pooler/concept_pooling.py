"""Pool concepts' passages on the fly: token activations live for one batch, pooled vectors are kept.

The extractor computes only what the requested strategies need (attention inflow, gradients); parses and each
concept's train-split statistics are prepared once per concept and handed to every batch as extras. Several
concepts may share forwards (pool_concept_group): a concept of a few dozen passages then fills the batches
another leaves partly empty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from poolbench.config import resolve_overlap
from poolbench.corpus.passage import Passage
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.capture import capture_chunks, resolve_max_batch_tokens
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.loading import LoadedModel
from poolbench.extractor.padded_batches import PaddedBatch, pad_batches, tokenize_passages
from poolbench.pooler.chunk_extras import ChunkExtras, concept_text
from poolbench.pooler.device_pool import DevicePooler, HostBuffers, HostPooler, prepare_chunk_pooler
from poolbench.pooler.gradient_sums import GradientTableBuilder, GradientTee
from poolbench.pooler.iti import FRACTION_META, HEADS_META, ITIHeadTableBuilder, selects_heads
from poolbench.pooler.learned import LearnedStates, TokenKeeper, is_learned
from poolbench.pooler.parses import ParseIndex
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
    layer_gradients: dict[int, pa.Table] | None = None  # gradient_sums tables, where S2's backward ran
    layer_learned: dict[int, pa.Table] | None = None  # LearnedFoldTable per layer, with a learned aggregator

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


@dataclass(frozen=True)
class ConceptPassages:
    """One concept of a pooling job: its passages, the metadata its tables carry, and its parses when they were
    read from the store (else parsed here when a strategy needs them)."""

    concept: str
    passages: Sequence[Passage]
    metadata: Mapping[str, str] = field(default_factory=dict)
    parses: ParseIndex | None = None


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
    overlap: bool | None = None,
    site: str = "residual",
) -> PooledConcept:
    """Extract every requested layer in one forward per batch and pool all strategies inside that forward.

    Pooling runs on the model's device in the capture (device_pool.DevicePooler): only pooled vectors leave it.
    `device_pooling=False` or `keep_activations=True` (on_batch then gets each chunk's ActivationBatch, e.g. for
    activation dumps) pool the reference way, token states to the host and numpy `pool_tokens`; otherwise
    on_batch gets the PaddedBatch. `parses` (e.g. the cached artifact) serves strategies that need them;
    without it they are parsed here. `max_batch_tokens` bounds each forward (None: from free memory, at most the
    device's budget_cap); the table is the same whatever it is up to the forward's round-off (another bucketing is
    another computation: docs/reproducibility.md). Passages that do not fit the device alone are left out, in
    `skipped`."""
    concept = passages[0].concept if passages else ""
    member = ConceptPassages(concept, passages, dict(metadata or {}), parses)
    each = None if on_batch is None else (
        lambda chunk, activations: on_batch(activations if activations is not None else chunk))
    [pooled] = pool_concept_group(loaded, [member], layers, specs, batch_size=batch_size, max_length=max_length,
                                  on_batch=each, max_batch_tokens=max_batch_tokens, device_pooling=device_pooling,
                                  keep_activations=keep_activations, stats=stats, overlap=overlap, site=site)
    return pooled


def pool_concept_group(
    loaded: LoadedModel,
    members: Sequence[ConceptPassages],
    layers: Sequence[int],
    specs: Sequence[StrategySpec],
    *,
    batch_size: int = 32,
    max_length: int = 256,
    on_batch: Callable[[PaddedBatch, ActivationBatch | None], None] | None = None,
    max_batch_tokens: int | None = None,
    device_pooling: bool = True,
    keep_activations: bool = False,
    stats: ExtractionStats | None = None,
    overlap: bool | None = None,
    site: str = "residual",
) -> list[PooledConcept]:
    """pool_concept_tables for several concepts sharing forwards: batches are planned over the union of their
    passages (length-bucketed), and each chunk's pooled rows go back to their own concept's tables, each
    concept's equal to what it pools alone (rows differ only by the padding their forward shared).

    Each row is weighted with its own concept's parses and train-split statistics (chunk_extras.ChunkExtras);
    `remove_first_pc` variants are fitted per concept. `overlap` (default: on CUDA) prepares the next chunk's
    text extras and weights on a background thread while the current chunk's forward runs, and adds each chunk's
    rows to the tables on another while the next chunk's forward runs. `on_batch(chunk,
    activations)` sees every chunk (its `indices` count through the members' passages in order), with its
    ActivationBatch where token states went to the host. `site` pools each layer's block output (residual) or its
    attention / MLP sub-block's output (extractor.site_hooks). Returns one PooledConcept per member, in order."""
    specs = list(specs)
    needs = strategy_needs(specs)
    check_encoder_support(loaded.kind, specs)
    passages = [p for member in members for p in member.passages]
    owner = np.repeat(np.arange(len(members)), [len(member.passages) for member in members])
    tokens = tokenize_passages(loaded.tokenizer, [p.text for p in passages], [p.id for p in passages], max_length)
    # Buckets are cut at the budget too, not only chunked within it: a bucket of fewer rows pads less (rows are
    # sorted by length), and a CPU's budget is small (batching.CPU_MAX_BATCH_TOKENS).
    budget = resolve_max_batch_tokens(loaded.model, layers, max_batch_tokens)
    batches = pad_batches(loaded.tokenizer, tokens, batch_size=batch_size, max_tokens=budget)
    starts = np.concatenate([[0], np.cumsum([len(member.passages) for member in members])]).astype(int)

    def text_side() -> ChunkExtras:
        """The members' parses and train-split statistics: made by the first chunk's preparation, which runs
        beside the first forward with overlap (capture.capture_chunks), not before it."""
        texts = [concept_text(member.concept, member.passages, tokens, range(starts[i], starts[i + 1]), needs,
                              member.parses) for i, member in enumerate(members)]
        return ChunkExtras(texts, owner, needs, loaded.tokenizer)

    extras = _Once(text_side)
    builders = [PooledTableBuilder(member.passages, loaded.hidden_size) for member in members]
    heads = [{int(layer): ITIHeadTableBuilder(loaded.hidden_size) for layer in layers} for _ in members]
    metadata = [dict(member.metadata) for member in members]
    head_metadata = [dict(member.metadata) for member in members]
    stats = stats if stats is not None else ExtractionStats()
    skipped_before = len(stats.skipped)
    device = None if keep_activations or not device_pooling else next(loaded.model.parameters()).device
    overlap = resolve_overlap(overlap, device is not None and device.type == "cuda")
    supervised = [spec for spec in specs if selects_heads(spec)]
    learned = [spec for spec in specs if is_learned(spec)]
    kept_states = LearnedStates(layers) if learned else None
    gradients = [GradientTableBuilder(loaded.hidden_size) for _ in members] if "gradient" in needs else None
    buffers = HostBuffers(pin=device.type == "cuda") if device is not None else None  # reused chunk after chunk

    def prepare(chunk: PaddedBatch) -> Callable[[], DevicePooler | HostPooler | GradientTee | TokenKeeper]:
        """The CPU side of a chunk: its rows' text extras and static weights, ready to send; S2's gradient sums
        and the learned aggregators' kept token states are sinks around the pooling sink."""
        make = prepare_chunk_pooler(specs, chunk, layers, extras()(chunk), device, buffers)

        def wrapped() -> DevicePooler | HostPooler | GradientTee | TokenKeeper:
            sink = make() if gradients is None else GradientTee(make(), chunk)
            return sink if not learned else TokenKeeper(sink, chunk, layers)

        return wrapped

    last_planned = batches[-1].indices[-1] if batches else -1

    def build(chunk: PaddedBatch, sink: DevicePooler | HostPooler | GradientTee | TokenKeeper) -> None:
        """A captured chunk's rows into its concepts' tables (copied out of the pooler's host buffer, which then
        serves a later chunk). The job's last chunk (it holds the plan's last passage: halves keep their order)
        hands its buffer over to the tables instead, with no copy: after the last forward nothing else runs."""
        keeper = sink if isinstance(sink, TokenKeeper) else None
        outer = keeper.sink if keeper is not None else sink
        tee = outer if isinstance(outer, GradientTee) else None
        pooler = tee.inner if tee is not None else outer
        assert isinstance(pooler, (DevicePooler, HostPooler))
        if on_batch is not None:
            on_batch(chunk, pooler.activations)
        if kept_states is not None and keeper is not None:
            kept_states.add(chunk, keeper)
        pooled = pooler.pooled
        assert pooled is not None
        final = chunk.indices[-1] == last_planned
        for i, rows in _rows_by_owner(extras().owners(chunk)):
            ids = pooled.passage_ids if rows is None else [pooled.passage_ids[r] for r in rows]
            if gradients is not None and tee is not None:
                gradients[i].add(tee, rows)
            builders[i].add(pooled.vectors, pooled.layers, pooled.strategy_ids, ids,
                            _take(pooled.fallback, rows, 1), rows, copy=not final)  # each layer's rows
            for spec in supervised:
                assert pooler.heads is not None
                per_head, outputs = pooler.heads
                metadata[i][f"{spec.id}{HEADS_META}"] = str(per_head.shape[2])
                head_metadata[i][f"{spec.id}{FRACTION_META}"] = str(spec.param("head_fraction"))
                for j, layer in enumerate(pooled.layers):  # a copy a layer: each layer's table owns its memory
                    heads[i][int(layer)].add(spec.id, [layer], ids, _take(per_head[j:j + 1], rows, 1, not final),
                                             _take(outputs[j:j + 1], rows, 1, not final))
        stats.pool_seconds += pooler.pool_seconds
        stats.transfer_seconds += pooler.transfer_seconds
        if final:
            pooler.hand_over()
        else:
            pooler.release()

    with ThreadPoolExecutor(1, thread_name_prefix="poolbench-tables") if overlap else nullcontext() as table_thread:
        pending: Future | None = None
        for chunk, sink in capture_chunks(loaded.model, loaded.decoder_layers, batches, layers, prepare_for=prepare,
                                          overlap=overlap, needs=needs, max_batch_tokens=budget,
                                          stats=stats, site=site):
            if table_thread is None:
                build(chunk, sink)
                continue
            if pending is not None:  # one chunk's tables at a time, in order
                pending.result()
            pending = table_thread.submit(build, chunk, sink)  # beside the next chunk's forward
        if pending is not None:
            pending.result()
    skipped: list[list[tuple[str, int]]] = [[] for _ in members]
    for (passage_id, n_tokens), index in zip(stats.skipped[skipped_before:], stats.skipped_indices[skipped_before:],
                                             strict=True):
        skipped[int(owner[index])].append((passage_id, n_tokens))
    out = []
    for i, builder in enumerate(builders):
        tables = builder.layer_tables(metadata[i])
        for spec in specs:
            if dict(spec.params).get("remove_first_pc") is True:
                tables = {layer: _remove_first_pc(table, spec.id) for layer, table in tables.items()}
        learned_tables = None
        if kept_states is not None:
            tables, learned_tables = kept_states.fit_member(members[i].passages, int(starts[i]), tables, learned,
                                                            loaded.hidden_size)
        out.append(PooledConcept(tables, {layer: heads[i][layer].table(head_metadata[i]) for layer in tables}
                                 if supervised else None, tuple(skipped[i]),
                                 gradients[i].layer_tables() if gradients is not None else None, learned_tables))
    return out


class _Once:
    """A value made by its first caller, whichever thread that is; later callers wait for it and share it."""

    def __init__(self, make: Callable[[], ChunkExtras]) -> None:
        self._make, self._value, self._lock = make, None, threading.Lock()

    def __call__(self) -> ChunkExtras:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value


def _rows_by_owner(owners: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
    """(concept, its rows of the chunk) per concept present; rows None when the whole chunk is one concept's."""
    present = np.unique(owners)
    if len(present) == 1:
        return [(int(present[0]), None)]
    return [(int(i), np.flatnonzero(owners == i)) for i in present]


def _take(values: np.ndarray, rows: np.ndarray | None, axis: int, copy: bool = True) -> np.ndarray:
    """The rows as a new array (a pooler's arrays are views of a host buffer that later chunks reuse), or all of
    them as they are where `copy` is False (a buffer handed over to the tables)."""
    return (np.array if copy else np.asarray)(values) if rows is None else np.take(values, rows, axis=axis)


def _remove_first_pc(table: pa.Table, strategy_id: str) -> pa.Table:
    """SIF's common-component removal per layer and per split, each split's component fitted on its own rows (the
    reference pools its train and test partitions apart and fits PCA(1) on each)."""
    vector = table.column("vector").combine_chunks()
    dim = vector.type.list_size
    X = vector.values.to_numpy(zero_copy_only=False).reshape(-1, dim).copy()
    strategy = table.column("strategy").to_numpy(zero_copy_only=False)
    layer = table.column("layer").to_numpy(zero_copy_only=False)
    split = table.column("split").to_numpy(zero_copy_only=False)
    for value in np.unique(layer):
        for part in np.unique(split):
            rows = np.flatnonzero((strategy == strategy_id) & (layer == value) & (split == part))
            X[rows] = remove_first_component(X[rows], np.ones(len(rows), dtype=bool))
    column = pa.FixedSizeListArray.from_arrays(pa.array(X.reshape(-1), pa.float32()), dim)
    return table.set_column(table.schema.get_field_index("vector"), table.schema.field("vector"), column)
