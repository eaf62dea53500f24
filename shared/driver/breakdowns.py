"""Two per-run readings of D1 that need no model: the lexical baseline per concept, and D1 by density and placement
for a few strategies at their CV-chosen layer (their probes refitted from the stored pooled vectors)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.corpus.passage import PLACEMENTS, Passage
from poolbench.pooler.pooled_table import PooledTableView, read_pooled_table
from poolbench.prober.buckets import bucket_aurocs, heldout_scores
from poolbench.prober.lexical import lexical_record
from poolbench.prober.reliability import cv_chosen_layers
from poolbench.records.buckets import BucketAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.store.artifact_store import ArtifactStore

BUCKET_STRATEGIES = ("A1_mean", "P1_last", "W1_first_k", "W2_last_k")
"""Beside the best strategy: the mean, the last token and the two end windows, whose reach differs by place."""
BUCKET_FIELDS = ("density", "placement")
CI_LEVEL = 0.95


def lexical_baselines(passages_by_concept: dict[str, Sequence[Passage]], *, n_bootstrap: int,
                      seed: int) -> list[LexicalBaselineRecord]:
    """One lexical baseline per concept, in the order given."""
    return [lexical_record(concept, passages, n_bootstrap=n_bootstrap, seed=seed, ci_level=CI_LEVEL)
            for concept, passages in passages_by_concept.items()]


def bucket_cells(records: Sequence[D1CellRecord], supervised: set[str]) -> dict[str, int]:
    """Strategy -> CV-chosen layer for the best unsupervised strategy (mean held-out D1 there) and
    BUCKET_STRATEGIES; supervised strategies choose heads per fold, which a refit here would not repeat."""
    layers = cv_chosen_layers([r.to_dict() for r in records])
    by_strategy: dict[str, list[float]] = {}
    for r in records:
        if r.probe == "logistic" and layers.get(r.strategy) == r.layer and r.strategy not in supervised:
            by_strategy.setdefault(r.strategy, []).append(float(r.test_auroc))
    if not by_strategy:
        return {}
    best = min(by_strategy, key=lambda s: (-float(np.mean(by_strategy[s])), s))
    chosen = [best] + [s for s in BUCKET_STRATEGIES if s in by_strategy and s != best]
    return {s: layers[s] for s in chosen}


def d1_by_bucket(store: ArtifactStore, pooled_keys: dict[str, str], passages_by_concept: dict[str, Sequence[Passage]],
                 records: Sequence[D1CellRecord], supervised: set[str], *, n_bootstrap: int,
                 seed: int) -> list[BucketAurocRecord]:
    """Per chosen strategy and per density / placement bucket, the held-out AUROC over every concept's test
    passages; empty when the corpus records no density and placement (v1, most user corpora)."""
    meta = {c: {p.id: p for p in ps} for c, ps in passages_by_concept.items()}
    if not any(p.density is not None and p.placement is not None for ps in meta.values() for p in ps.values()):
        return []
    cells = bucket_cells(records, supervised)
    columns: dict[str, dict[str, list]] = {s: {k: [] for k in ("scores", "labels", "groups", "concepts",
                                                              *BUCKET_FIELDS)} for s in cells}
    for concept, key in pooled_keys.items():
        view = PooledTableView(read_pooled_table(store, key, sorted(set(cells.values()))))
        for strategy, layer in cells.items():
            cell = view.matrix(layer, strategy)
            train, test = cell.subset("train"), cell.subset("test")
            passages = [meta[concept][str(pid)] for pid in test.passage_ids]
            kept = [i for i, p in enumerate(passages) if p.density is not None and p.placement is not None]
            col = columns[strategy]
            col["scores"].extend(heldout_scores(train.X, train.y, test.X, seed)[kept])
            col["labels"].extend(test.y[kept])
            col["groups"].extend(str(g) for g in test.groups[kept])
            col["concepts"].extend([concept] * len(kept))
            col["density"].extend(str(passages[i].density) for i in kept)
            col["placement"].extend(str(passages[i].placement) for i in kept)
    out = []
    for strategy, layer in cells.items():
        col = columns[strategy]
        for by in BUCKET_FIELDS:
            for b in bucket_aurocs(np.array(col["scores"]), np.array(col["labels"]), np.array(col["groups"]),
                                   np.array(col["concepts"]), np.array(col[by]), n_bootstrap=n_bootstrap,
                                   seed=seed, ci_level=CI_LEVEL, order=PLACEMENTS):
                out.append(BucketAurocRecord(
                    strategy=strategy, layer=layer, probe="logistic", by=by, bucket=b.bucket, auroc=b.auroc,
                    ci_low=b.ci_low, ci_high=b.ci_high, ci_level=CI_LEVEL, n=b.n, n_pos=b.n_pos, n_neg=b.n_neg,
                    n_concepts=b.n_strata, n_bootstrap=n_bootstrap, concept_aurocs=b.stratum_aurocs,
                    comparisons="across_pairs", auroc_with_twins=b.auroc_with_twins))
    return out
