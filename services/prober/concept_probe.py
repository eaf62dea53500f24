"""D1 for every (layer, strategy) cell of a PooledTable, the Ray task that probes one (concept, layer) shard, and
the gathering of a concept's layers into its D1 artifact.

Every D1 statistic is a function of one cell, so probing layer by layer gives the same records as probing the
whole concept; what spans layers (the CV-chosen layer, win rate, Friedman) is computed later from the records."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from poolbench.config import ProbingOptions
from poolbench.defaults import DEFAULT_PROTOCOL, PB_PROTOCOL
from poolbench.pooler.iti import HEADS_META, ITIHeadView, head_table_key, needs_head_table
from poolbench.pooler.learned import FITS_META, LearnedFoldView, learned_table_key, needs_learned_table
from poolbench.pooler.pooled_table import PooledMatrix, PooledTableView
from poolbench.prober.auroc import ProbeError
from poolbench.prober.batched_cell import batched_d1_cells, cells_per_call, probe_device
from poolbench.prober.d1 import D1Result, evaluate_d1
from poolbench.prober.flash import flash_subset, parse_fraction
from poolbench.prober.learned_cell import LearnedFoldCell, learned_fold_cell
from poolbench.prober.newton_logistic import UnconvergedFitWarning
from poolbench.prober.passage_scores import (
    HELDOUT,
    OUT_OF_FOLD,
    cell_scores_table,
    concat_scores,
    passage_scores_key,
)
from poolbench.prober.pb_protocol import PB_CI_METHOD, corpus_rows, pb_d1
from poolbench.prober.reliability import cell_reliability
from poolbench.prober.supervised import HeadSelectionCell, evaluate_d1_supervised, head_selection_cell
from poolbench.records.d1 import D1CellRecord, d1_records_from_table, d1_records_table
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key

LOG = logging.getLogger(__name__)

D1_VERSION = 10  # 2: per-cell reliability statistics, supervised (S3) cells; 3: Newton logistic probe;
# 4: one D1 artifact per (concept, layer), gathered into the concept's; 5: pair-clustered DeLong CI, type control;
# 6: every cell's per-passage held-out and out-of-fold scores stored beside its records; 7: a cell's fits batched
# (batched_cell): make run's mean CV AUROC moved in the third decimal for 5 of 19 strategies (P2_first 0.567 -> 0.577),
# held-out D1 unchanged, so no stored cell of the per-fit path is read beside the batched ones; 8: equal rows score
# bit-identically (distinct_rows) and a no-signal fold stays at its cold start: both paths equal again on those cells
# 9: small cells' own-Gram (exact) factors in float64 with the shared Gram as fallback: 8's float32 factors left 8 of
# make run's 3,876 cells' CV AUROCs (and MDL) off the per-fit path's; now equal; 10: each batched fit keeps its own
# Newton factor (an expanded view had them share one where a fit was converged from the start: 28 of make run's MDL
# fit calls ended short of the stopping rule, unreported), and a fit that still cannot reach it is fitted again one
# at a time (frustration layer 12 A2_max: coefficients inf, MDL compression 0.0017 off the per-fit path's)


def probe_pooled_table(table: pa.Table, concept: str, *, n_folds: int = 5, seed: int = 0,
                       n_bootstrap: int = 1000, reliability: bool = True, flash: str | None = None,
                       heads: pa.Table | None = None, types: dict[str, str] | None = None,
                       protocol: str = DEFAULT_PROTOCOL, learned: pa.Table | None = None,
                       corpus_order: Sequence[str] | None = None) -> list[D1CellRecord]:
    """One record per (layer, strategy, probe): CV AUROC on train, held-out AUROC with its CI, fallbacks.

    `heads` is the ITIHeadTable that pooling made beside `table`; supervised (S3) cells need it. `types` maps a
    passage id to its lexical type (domain), the control task's unit; without it selectivity is n/a.
    `protocol="pb"`: the reference leaderboard's D1 instead (pb_protocol.pb_d1, diffmean only), over the train split
    in `corpus_order` (the concept's passage ids as its corpus files list them)."""
    return probe_pooled_cells(table, concept, n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap,
                              reliability=reliability, flash=flash, heads=heads, types=types, protocol=protocol,
                              learned=learned, corpus_order=corpus_order)[0]


def probe_pooled_cells(table: pa.Table, concept: str, *, n_folds: int = 5, seed: int = 0,
                       n_bootstrap: int = 1000, reliability: bool = True, flash: str | None = None,
                       heads: pa.Table | None = None, types: dict[str, str] | None = None,
                       tiers: dict[str, str | None] | None = None,
                       protocol: str = DEFAULT_PROTOCOL,
                       learned: pa.Table | None = None,
                       corpus_order: Sequence[str] | None = None,
                       batched: bool = True) -> tuple[list[D1CellRecord], pa.Table]:
    """probe_pooled_table's records and, beside them, every cell's per-passage scores of the very fits the
    records report (held-out and out-of-fold, S3's fold-chosen heads included), `tiers` naming each passage's.
    `batched`: an unsupervised cell's logistic fits run together (batched_cell, on the GPU when present); False is
    the one-fit-at-a-time reference path, equal within the solver's stopping rule.
    The PB protocol keeps no per-passage scores (its records are CV-only and stand apart from the paired tests)."""
    if protocol == PB_PROTOCOL:
        if corpus_order is None:
            raise ProbeError(f"{concept}: the pb protocol folds the train split in corpus order; give corpus_order")
        return pb_records(table, concept, corpus_order), concat_scores([])
    view = PooledTableView(table)
    scores = []
    head_view = ITIHeadView(heads) if heads is not None else None
    learned_view = LearnedFoldView(learned) if learned is not None else None
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    cells = []
    # S3's fits run on the probes' GPU; on a CPU one host estimator a fit, as make run's records were computed
    device = probe_device()
    gpu = device if batched and device.type != "cpu" else None
    for layer, strategy in view.cells:
        cell = view.matrix(layer, strategy)
        with fits_named(concept, layer, strategy):  # S3's head ranking fits probes too
            supervised = (head_selection_cell(cell, metadata, head_view, layer, strategy, seed, device=gpu)
                          or learned_fold_cell(cell, metadata, learned_view, layer, strategy))
        train_rows = np.flatnonzero(cell.split == "train")
        if flash is not None:  # a stratified, pair-preserving fraction of train; test stays whole
            kept = flash_subset(cell.y[train_rows], cell.groups[train_rows], parse_fraction(flash), seed=seed,
                                concept=concept, min_per_class=n_folds)
            train_rows = train_rows[kept]
        train, test = cell.take(train_rows), cell.subset("test")
        types_train = (None if types is None or not reliability or supervised is not None else
                       np.array([types.get(str(pid), str(pid)) for pid in train.passage_ids]))
        cells.append(_Cell(layer, strategy, cell, supervised, train_rows, train, test, types_train))
    options = {"n_folds": n_folds, "seed": seed, "n_bootstrap": n_bootstrap}
    outcomes = _batched_outcomes(concept, cells, reliability=reliability, **options) if batched else {}
    records = []
    for i, c in enumerate(cells):
        layer, strategy, cell, supervised, train_rows = c.layer, c.strategy, c.cell, c.supervised, c.train_rows
        stats: dict = {}
        with fits_named(concept, layer, strategy):
            if i in outcomes:
                result, stats = outcomes[i]
            elif supervised is None:
                train, test = c.train, c.test
                result = evaluate_d1(train.X, train.y, train.groups, test.X, test.y, test.groups, **options)
                if reliability:
                    stats = cell_reliability(train.X, train.y, train.groups, train.passage_ids, test.X, test.y,
                                             test.groups, seed=seed, n_folds=n_folds, types_train=c.types_train,
                                             d1_cv_auroc=result.probes["logistic"].cv_auroc)
            else:  # heads are chosen inside each fold from that fold's training labels only
                result = evaluate_d1_supervised(supervised, cell.y, cell.groups, train_rows,
                                                np.flatnonzero(cell.split == "test"), **options)
        fallback_count = int(cell.fallback.sum())
        test_rows = np.flatnonzero(cell.split == "test")
        for probe_name, probe in result.probes.items():
            for kind, rows, values, folds in ((HELDOUT, test_rows, probe.test_scores, None),
                                              (OUT_OF_FOLD, train_rows, probe.oof_scores, probe.oof_folds)):
                scores.append(cell_scores_table(concept, layer, strategy, probe_name, kind, cell.passage_ids[rows],
                                                cell.groups[rows], cell.y[rows], values, folds=folds, tiers=tiers))
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
    return records, concat_scores(scores)


@dataclass(frozen=True)
class _Cell:
    """One (layer, strategy) cell's rows as D1 probes them: its matrix, train (after flash) and test views, the
    supervised features (S3, learned) where it has them, the train passages' lexical types."""

    layer: int
    strategy: str
    cell: PooledMatrix
    supervised: HeadSelectionCell | LearnedFoldCell | None
    train_rows: np.ndarray
    train: PooledMatrix
    test: PooledMatrix
    types_train: np.ndarray | None


def _batched_outcomes(concept: str, cells: Sequence[_Cell], *, n_folds: int, seed: int, n_bootstrap: int,
                      reliability: bool) -> dict[int, tuple[D1Result, dict]]:
    """(D1Result, reliability stats) of every unsupervised cell by the batched solver, by the cell's index: cells of
    one layer with the same passages, labels, pairs, types and width go to batched_d1_cells together, at most
    cells_per_call(device) at once (on a CPU one: each cell's records as make run's)."""
    per_call = cells_per_call(probe_device())
    groups: list[list[int]] = []
    for i, c in enumerate(cells):
        if c.supervised is not None:
            continue
        group = next((g for g in groups if len(g) < per_call and _same_rows(cells[g[0]], c)), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    out = {}
    for group in groups:
        first = cells[group[0]]
        with fits_named(concept, first.layer, "+".join(cells[i].strategy for i in group)):
            found = batched_d1_cells([cells[i].train.X for i in group], first.train.y, first.train.groups,
                                     [cells[i].test.X for i in group], first.test.y, first.test.groups,
                                     n_folds=n_folds, seed=seed, n_bootstrap=n_bootstrap, reliability=reliability,
                                     types_train=first.types_train)
        out.update(zip(group, found, strict=True))
    return out


def _same_rows(a: _Cell, b: _Cell) -> bool:
    """Whether two cells can be probed in one batch: one layer, the same train and test rows (labels, pairs, lexical
    types) and one feature width."""
    same = a.layer == b.layer and a.train.X.shape[1] == b.train.X.shape[1] == b.test.X.shape[1]
    arrays = ((a.train.y, b.train.y), (a.train.groups, b.train.groups), (a.test.y, b.test.y),
              (a.test.groups, b.test.groups))
    types = (a.types_train is None and b.types_train is None) or (
        a.types_train is not None and b.types_train is not None and np.array_equal(a.types_train, b.types_train))
    return same and types and all(x.shape == y.shape and np.array_equal(x, y) for x, y in arrays)


@contextlib.contextmanager
def fits_named(concept: str, layer: int, strategy: str) -> Iterator[None]:
    """A logistic fit that stopped at max_iter (UnconvergedFitWarning) is logged with the cell it belongs to, once
    per cell and fit call: the solvers cannot name the cell, and a warning without one tells a user nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnconvergedFitWarning)
        yield
    for w in caught:
        if issubclass(w.category, UnconvergedFitWarning):
            LOG.warning("%s layer %d %s: %s", concept, layer, strategy, w.message)
        else:  # everything else as it came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def pb_records(table: pa.Table, concept: str, corpus_order: Sequence[str]) -> list[D1CellRecord]:
    """The PB protocol's D1 of every unsupervised cell: one diffmean record each, from the train split only, its rows
    in corpus order (`corpus_order`, the concept's passage ids as its corpus files list them: the reference folds
    over that order; the table's own follows the pooling batches). A supervised cell's features (S3's heads, a
    learned aggregator's fits) are fitted per fold of PoolBench's own protocol, so it has none here."""
    view = PooledTableView(table)
    supervised = {k.decode().removesuffix(suffix) for k in (table.schema.metadata or {})
                  for suffix in (HEADS_META, FITS_META) if k.decode().endswith(suffix)}
    records = []
    for layer, strategy in view.cells:
        if strategy in supervised:
            continue
        cell = view.matrix(layer, strategy)
        train = cell.subset("train")
        train = train.take(corpus_rows(train.passage_ids, corpus_order))
        result = pb_d1(train.X, train.y)
        fallback_count = int(train.fallback.sum())
        records.append(D1CellRecord(
            concept=concept, layer=layer, strategy=strategy, probe="diffmean", cv_auroc=result.auroc,
            test_auroc=result.auroc, ci_low=result.ci_low, ci_high=result.ci_high, ci_level=0.95,
            ci_method=PB_CI_METHOD, n_train=int(train.y.size), n_test=0, n_folds=result.n_folds,
            n_bootstrap=result.n_bootstrap, fallback_count=fallback_count,
            fallback_rate=fallback_count / max(len(train.fallback), 1), protocol=PB_PROTOCOL))
    return records


def probe_layer_task(store_url: str, pooled_key: str, d1_key: str, concept: str, layer: int,
                     probing: ProbingOptions, *, types: dict[str, str] | None = None,
                     tiers: dict[str, str | None] | None = None, corpus_order: Sequence[str] | None = None) -> dict:
    """Read one layer's PooledTable shard (and its ITIHeadTable shard for S3), write that layer's D1 records
    under `layer_shard_key(d1_key, layer)` and its per-passage scores beside them (scores first: a stored record
    shard means its scores are stored); a task holds one layer's vectors, never the concept's. Safe to retry.
    `probing` is the run's D1 group; `corpus_order` the concept's passage ids in corpus order (the pb protocol's)."""
    from poolbench.store.url import open_store

    process = _task_process()
    return {**probe_layer(open_store(store_url), pooled_key, d1_key, concept, layer, probing, types=types,
                          tiers=tiers, corpus_order=corpus_order), **process}


_TASKS_IN_THIS_PROCESS = itertools.count()  # probe tasks this process has started


def _task_process() -> dict:
    """Which process runs this task: its pid, how many probe tasks it ran before this one (0: this task paid the
    process's start, imports and, on a GPU, CUDA's), and the GPUs Ray made visible to this task
    (CUDA_VISIBLE_DEVICES). A process CUDA has started in keeps the GPU it saw first, whatever a later task is
    given, so the driver reuses probe processes only where a node has one GPU (driver/probe_tasks.py)."""
    return {"pid": os.getpid(), "earlier_tasks": next(_TASKS_IN_THIS_PROCESS),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def probe_layer(store: ArtifactStore, pooled_key: str, d1_key: str, concept: str, layer: int,
                probing: ProbingOptions, *, types: dict[str, str] | None = None,
                tiers: dict[str, str | None] | None = None, corpus_order: Sequence[str] | None = None) -> dict:
    """probe_layer_task's work on an open store (either backend); its seconds reading, fitting and writing come
    back with the layer (the driver's LayerProbed event)."""
    start = time.perf_counter()
    shard_key = layer_shard_key(pooled_key, layer)
    table = store.get_table(shard_key)
    own = probing.protocol == DEFAULT_PROTOCOL  # only PoolBench's protocol probes supervised (S3, learned) cells
    heads = store.get_table(head_table_key(shard_key)) if needs_head_table(table) and own else None
    learned = store.get_table(learned_table_key(shard_key)) if needs_learned_table(table) and own else None
    read = time.perf_counter()
    records, scores = probe_pooled_cells(table, concept, n_folds=probing.n_folds, seed=probing.seed,
                                         n_bootstrap=probing.n_bootstrap, reliability=probing.reliability,
                                         flash=probing.flash, heads=heads, types=types, tiers=tiers,
                                         protocol=probing.protocol, learned=learned, corpus_order=corpus_order)
    probed = time.perf_counter()
    key = layer_shard_key(d1_key, layer)
    store.put_table(passage_scores_key(key), scores)
    store.put_table(key, d1_records_table(records))
    return {"concept": concept, "layer": layer, "key": key, "cells": len(records), "read_s": read - start,
            "probe_s": probed - read, "write_s": time.perf_counter() - probed}


def gather_layer_d1(store: ArtifactStore, d1_key: str, layers: list[int]) -> int:
    """Write the concept's D1 artifact from its layers' D1 artifacts, in layer order (the order one whole-concept
    probe gives), its per-passage score table first; returns the number of records."""
    shards = [layer_shard_key(d1_key, layer) for layer in sorted(layers)]
    store.put_table(passage_scores_key(d1_key),
                    concat_scores([store.get_table(passage_scores_key(shard)) for shard in shards]))
    records = [record for shard in shards for record in d1_records_from_table(store.get_table(shard))]
    store.put_table(d1_key, d1_records_table(records))
    return len(records)
