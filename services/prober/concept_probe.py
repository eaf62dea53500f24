"""D1 for every (layer, strategy) cell of one concept's PooledTable, and the Ray task around it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from poolbench.pooler.pooled_table import PooledTableView
from poolbench.prober.d1 import evaluate_d1
from poolbench.prober.supervised import evaluate_d1_supervised, head_selection_cell, is_auxiliary

D1_VERSION = 1


def probe_pooled_table(table: pa.Table, concept: str, *, n_folds: int = 5, seed: int = 0,
                       n_bootstrap: int = 1000) -> list[dict]:
    """One record per (layer, strategy, probe): CV AUROC on train, held-out AUROC with its CI, fallbacks."""
    view = PooledTableView(table)
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    records = []
    for layer, strategy in view.cells:
        if is_auxiliary(strategy):  # per-head rows feed their supervised cell below
            continue
        cell = view.matrix(layer, strategy)
        supervised = head_selection_cell(view, metadata, layer, strategy, seed)
        if supervised is None:
            train, test = cell.subset("train"), cell.subset("test")
            result = evaluate_d1(train.X, train.y, train.groups, test.X, test.y, test.groups,
                                 n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap)
        else:  # heads are chosen inside each fold from that fold's training labels only
            result = evaluate_d1_supervised(
                supervised, cell.y, cell.groups, np.flatnonzero(cell.split == "train"),
                np.flatnonzero(cell.split == "test"), n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap)
        fallback_count = int(cell.fallback.sum())
        for probe_name, probe in result.probes.items():
            records.append({
                "concept": concept, "layer": layer, "strategy": strategy, "probe": probe_name,
                **probe.to_record(),
                "fallback_count": fallback_count,
                "fallback_rate": fallback_count / len(cell.fallback),
                "heads_selected": supervised.chosen[-1] if supervised is not None else None,
            })
    return records


def probe_records_table(records: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(records)


def probe_concept_task(store_url: str, pooled_key: str, d1_key: str, concept: str, n_folds: int, seed: int,
                       n_bootstrap: int) -> dict:
    """Read a PooledTable, write the concept's D1 records as an Arrow artifact; safe to retry."""
    from poolbench.store import open_store

    store = open_store(store_url)
    records = probe_pooled_table(store.get_table(pooled_key), concept, n_folds=n_folds, seed=seed,
                                 n_bootstrap=n_bootstrap)
    store.put_table(d1_key, probe_records_table(records))
    return {"concept": concept, "key": d1_key, "cells": len(records)}
