"""D1 for every (layer, strategy) cell of a PooledTable, the Ray task that probes one (concept, layer) shard, and
the gathering of a concept's layers into its D1 artifact.

Every D1 statistic is a function of one cell, so probing layer by layer gives the same records as probing the
whole concept; what spans layers (the CV-chosen layer, win rate, Friedman) is computed later from the records."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from poolbench.pooler.iti import ITIHeadView, head_table_key, needs_head_table
from poolbench.pooler.learned import LearnedFoldView, learned_table_key, needs_learned_table
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.flash import flash_subset, parse_fraction
from poolbench.prober.learned_cell import learned_fold_cell
from poolbench.prober.reliability import cell_reliability
from poolbench.prober.supervised import evaluate_d1_supervised, head_selection_cell
from poolbench.records.d1 import D1CellRecord, d1_records_from_table, d1_records_table
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key

D1_VERSION = 5  # 2: per-cell reliability statistics, supervised (S3) cells; 3: Newton logistic probe;
# 4: one D1 artifact per (concept, layer), gathered into the concept's; 5: pair-clustered DeLong CI, type control


def probe_pooled_table(table: pa.Table, concept: str, *, n_folds: int = 5, seed: int = 0,
                       n_bootstrap: int = 1000, reliability: bool = True, flash: str | None = None,
                       heads: pa.Table | None = None, types: dict[str, str] | None = None,
                       learned: pa.Table | None = None) -> list[D1CellRecord]:
    """One record per (layer, strategy, probe): CV AUROC on train, held-out AUROC with its CI, fallbacks.

    `heads` is the ITIHeadTable that pooling made beside `table`; supervised (S3) cells need it. `types` maps a
    passage id to its lexical type (domain), the control task's unit; without it selectivity is n/a."""
    view = PooledTableView(table)
    head_view = ITIHeadView(heads) if heads is not None else None
    learned_view = LearnedFoldView(learned) if learned is not None else None
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    records = []
    for layer, strategy in view.cells:
        cell = view.matrix(layer, strategy)
        supervised = (head_selection_cell(cell, metadata, head_view, layer, strategy, seed)
                      or learned_fold_cell(cell, metadata, learned_view, layer, strategy))
        stats: dict = {}
        train_rows = np.flatnonzero(cell.split == "train")
        if flash is not None:  # a stratified, pair-preserving fraction of train; test stays whole
            kept = flash_subset(cell.y[train_rows], cell.groups[train_rows], parse_fraction(flash), seed=seed,
                                concept=concept, min_per_class=n_folds)
            train_rows = train_rows[kept]
        if supervised is None:
            train, test = cell.take(train_rows), cell.subset("test")
            result = evaluate_d1(train.X, train.y, train.groups, test.X, test.y, test.groups,
                                 n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap)
            if reliability:
                types_train = (None if types is None else
                               np.array([types.get(str(pid), str(pid)) for pid in train.passage_ids]))
                stats = cell_reliability(train.X, train.y, train.groups, train.passage_ids, test.X, test.y,
                                         test.groups, seed=seed, n_folds=n_folds, types_train=types_train)
        else:  # heads are chosen inside each fold from that fold's training labels only
            result = evaluate_d1_supervised(
                supervised, cell.y, cell.groups, train_rows,
                np.flatnonzero(cell.split == "test"), n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap)
        fallback_count = int(cell.fallback.sum())
        for probe_name, probe in result.probes.items():
            records.append(D1CellRecord(
                concept=concept, layer=layer, strategy=strategy,
                **probe.to_record(),
                fallback_count=fallback_count,
                fallback_rate=fallback_count / len(cell.fallback),
                heads_selected=getattr(supervised, "chosen", [None])[-1] if supervised is not None else None,
                # Seeds, selectivity and MDL describe the logistic probe; a supervised cell's features change
                # per fold, so they are not defined there (None, not a number computed on other features).
                **{key: (value if probe_name == "logistic" else None) for key, value in stats.items()},
            ))
    return records


def probe_layer_task(store_url: str, pooled_key: str, d1_key: str, concept: str, layer: int, n_folds: int,
                     seed: int, n_bootstrap: int, reliability: bool = True, flash: str | None = None,
                     types: dict[str, str] | None = None) -> dict:
    """Read one layer's PooledTable shard (and its ITIHeadTable shard for S3), write that layer's D1 records
    under `layer_shard_key(d1_key, layer)`; a task holds one layer's vectors, never the concept's. Safe to retry."""
    from poolbench.store.url import open_store

    store = open_store(store_url)
    shard_key = layer_shard_key(pooled_key, layer)
    table = store.get_table(shard_key)
    heads = store.get_table(head_table_key(shard_key)) if needs_head_table(table) else None
    learned = store.get_table(learned_table_key(shard_key)) if needs_learned_table(table) else None
    records = probe_pooled_table(table, concept, n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap,
                                 reliability=reliability, flash=flash, heads=heads, types=types, learned=learned)
    key = layer_shard_key(d1_key, layer)
    store.put_table(key, d1_records_table(records))
    return {"concept": concept, "layer": layer, "key": key, "cells": len(records)}


def gather_layer_d1(store: ArtifactStore, d1_key: str, layers: list[int]) -> int:
    """Write the concept's D1 artifact from its layers' D1 artifacts, in layer order (the order one whole-concept
    probe gives); returns the number of records."""
    records = [record for layer in sorted(layers)
               for record in d1_records_from_table(store.get_table(layer_shard_key(d1_key, layer)))]
    store.put_table(d1_key, d1_records_table(records))
    return len(records)
