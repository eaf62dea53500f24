"""D1 per tier (standard / hard) for every unsupervised strategy at its CV-chosen layer, and the lexical baseline per
concept and tier: the probes are refitted from the stored pooled vectors, as D1 by bucket does, so no model runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.corpus.passage import TIERS, Passage
from poolbench.pooler.pooled_table import PooledTableView, read_pooled_table
from poolbench.prober.buckets import bucket_aurocs, heldout_scores
from poolbench.prober.lexical import lexical_baseline
from poolbench.prober.reliability import cv_chosen_layers
from poolbench.records.d1 import D1CellRecord
from poolbench.records.tiers import LexicalTierRecord, TierAurocRecord
from poolbench.store.artifact_store import ArtifactStore

CI_LEVEL = 0.95


def has_tiers(passages_by_concept: dict[str, Sequence[Passage]]) -> bool:
    """Whether any test passage says its tier (the embedded corpus does; most user corpora do not)."""
    return any(p.tier is not None for ps in passages_by_concept.values() for p in ps if p.split == "test")


def d1_by_tier(store: ArtifactStore, pooled_keys: dict[str, str], passages_by_concept: dict[str, Sequence[Passage]],
               records: Sequence[D1CellRecord], supervised: set[str], *, n_bootstrap: int,
               seed: int) -> list[TierAurocRecord]:
    """Per unsupervised strategy and tier, the stratified held-out AUROC over every concept's test passages of that
    tier with a (concept, pair) bootstrap CI; empty when no passage records a tier. Supervised strategies choose
    heads per fold, which a refit here would not repeat, so they are left out."""
    if not has_tiers(passages_by_concept):
        return []
    layers = cv_chosen_layers([r.to_dict() for r in records if r.probe == "logistic"], probe="logistic")
    cells = {s: layer for s, layer in sorted(layers.items()) if s not in supervised}
    if not cells:
        return []
    meta = {c: {p.id: p for p in ps} for c, ps in passages_by_concept.items()}
    columns: dict[str, dict[str, list]] = {s: {k: [] for k in ("scores", "labels", "groups", "concepts", "tiers")}
                                           for s in cells}
    for concept, key in pooled_keys.items():
        view = PooledTableView(read_pooled_table(store, key, sorted(set(cells.values()))))
        for strategy, layer in cells.items():
            cell = view.matrix(layer, strategy)
            train, test = cell.subset("train"), cell.subset("test")
            passages = [meta[concept][str(pid)] for pid in test.passage_ids]
            kept = [i for i, p in enumerate(passages) if p.tier is not None]
            col = columns[strategy]
            col["scores"].extend(heldout_scores(train.X, train.y, test.X, seed)[kept])
            col["labels"].extend(test.y[kept])
            col["groups"].extend(str(g) for g in test.groups[kept])
            col["concepts"].extend([concept] * len(kept))
            col["tiers"].extend(str(passages[i].tier) for i in kept)
    out = []
    for strategy, layer in cells.items():
        col = columns[strategy]
        for b in bucket_aurocs(np.array(col["scores"]), np.array(col["labels"]), np.array(col["groups"]),
                               np.array(col["concepts"]), np.array(col["tiers"]), n_bootstrap=n_bootstrap,
                               seed=seed, ci_level=CI_LEVEL, order=TIERS):
            out.append(TierAurocRecord(
                strategy=strategy, layer=layer, probe="logistic", tier=b.bucket, auroc=b.auroc, ci_low=b.ci_low,
                ci_high=b.ci_high, ci_level=CI_LEVEL, n=b.n, n_pos=b.n_pos, n_neg=b.n_neg, n_concepts=b.n_strata,
                n_bootstrap=n_bootstrap, concept_aurocs=b.stratum_aurocs))
    return out


def lexical_by_tier(passages_by_concept: dict[str, Sequence[Passage]], *, n_bootstrap: int,
                    seed: int) -> list[LexicalTierRecord]:
    """Per concept and tier, the lexical baseline trained on the whole train split and scored on that tier's test
    passages (a tier with one class in test is skipped)."""
    out = []
    for concept, passages in passages_by_concept.items():
        train = [p for p in passages if p.split == "train"]
        for tier in TIERS:
            test = [p for p in passages if p.split == "test" and p.tier == tier]
            if len({p.label for p in test}) < 2:
                continue
            r = lexical_baseline([p.text for p in train], np.array([p.label for p in train]),
                                 [p.text for p in test], np.array([p.label for p in test]),
                                 np.array([p.group for p in test]), n_bootstrap=n_bootstrap, seed=seed,
                                 ci_level=CI_LEVEL)
            out.append(LexicalTierRecord(concept=concept, tier=tier, test_auroc=r.test_auroc, ci_low=r.ci_low,
                                         ci_high=r.ci_high, ci_level=CI_LEVEL, n_test=r.n_test,
                                         n_bootstrap=n_bootstrap))
    return out
