"""D1 for every (layer, strategy) cell of one concept's PooledTable, and the Ray task around it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from poolbench.pooler.iti import ITIHeadView, head_table_key, needs_head_table
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.flash import flash_subset, parse_fraction
from poolbench.prober.reliability import cell_reliability
from poolbench.prober.supervised import evaluate_d1_supervised, head_selection_cell
from poolbench.records.d1 import D1CellRecord, d1_records_table

D1_VERSION = 3  # 2: per-cell reliability statistics, supervised (S3) cells; 3: Newton logistic probe


def probe_pooled_table(table: pa.Table, concept: str, *, n_folds: int = 5, seed: int = 0,
                       n_bootstrap: int = 1000, reliability: bool = True, flash: str | None = None,
                       heads: pa.Table | None = None) -> list[D1CellRecord]:
    """One record per (layer, strategy, probe): CV AUROC on train, held-out AUROC with its CI, fallbacks.

    `heads` is the ITIHeadTable that pooling made beside `table`; supervised (S3) cells need it."""
    view = PooledTableView(table)
    head_view = ITIHeadView(heads) if heads is not None else None
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    records = []
    for layer, strategy in view.cells:
        cell = view.matrix(layer, strategy)
        supervised = head_selection_cell(cell, metadata, head_view, layer, strategy, seed)
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
                stats = cell_reliability(train.X, train.y, train.groups, train.passage_ids, test.X, test.y,
                                         test.groups, seed=seed, n_folds=n_folds)
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
                heads_selected=supervised.chosen[-1] if supervised is not None else None,
                # Seeds, selectivity and MDL describe the logistic probe; a supervised cell's features change
                # per fold, so they are not defined there (None, not a number computed on other features).
                **{key: (value if probe_name == "logistic" else None) for key, value in stats.items()},
            ))
    return records


def probe_concept_task(store_url: str, pooled_key: str, d1_key: str, concept: str, n_folds: int, seed: int,
                       n_bootstrap: int, reliability: bool = True, flash: str | None = None) -> dict:
    """Read a PooledTable, write the concept's D1 records as an Arrow artifact; safe to retry."""
    from poolbench.store.url import open_store

    store = open_store(store_url)
    table = store.get_table(pooled_key)
    heads = store.get_table(head_table_key(pooled_key)) if needs_head_table(table) else None
    records = probe_pooled_table(table, concept, n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap,
                                 reliability=reliability, flash=flash, heads=heads)
    store.put_table(d1_key, d1_records_table(records))
    return {"concept": concept, "key": d1_key, "cells": len(records)}
