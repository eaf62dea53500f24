"""Per-run readings of D1 that need no model: the lexical baseline per concept and per tier, and D1 by tier and by
density / placement for strategies at their CV-chosen layer, read from the held-out scores stored with each D1 cell
(the fit that reported test_auroc, fold-dependent strategies' included): nothing is refitted."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import PLACEMENTS, TIERS, Passage
from poolbench.prober.buckets import BucketAuroc, bucket_aurocs
from poolbench.prober.lexical import LexicalFit, lexical_record, score_lexical, train_fit
from poolbench.prober.passage_scores import held_out_cells
from poolbench.prober.reliability import cv_chosen_layers
from poolbench.records.breakdowns import BucketAurocRecord, LexicalTierRecord, TierAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord

BUCKET_STRATEGIES = ("A1_mean", "P1_last", "W1_first_k", "W2_last_k")
"""Beside the best strategy: the mean, the last token and the two end windows, whose reach differs by place."""
BUCKET_FIELDS = ("density", "placement")
CI_LEVEL = 0.95


@dataclass
class HeldoutColumns:
    """One (strategy, layer) cell's held-out probe scores over every concept's kept test passages, each passage
    beside its score, so any of its fields can split the AUROC."""

    scores: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    concepts: list[str] = field(default_factory=list)
    passages: list[Passage] = field(default_factory=list)

    def aurocs(self, subset: Callable[[Passage], object], order: Sequence[str], *, n_bootstrap: int,
               seed: int) -> list[BucketAuroc]:
        """The stratified AUROC across pairs per value of `subset(passage)`, CI over (concept, pair) units."""
        return bucket_aurocs(np.array(self.scores), np.array(self.labels), np.array(self.groups),
                             np.array(self.concepts), np.array([str(subset(p)) for p in self.passages]),
                             n_bootstrap=n_bootstrap, seed=seed, ci_level=CI_LEVEL, order=order)


def _subset_fields(b: BucketAuroc, n_bootstrap: int) -> dict:
    """The fields every SubsetAurocRecord takes from one bucket's AUROC."""
    return {"auroc": b.auroc, "ci_low": b.ci_low, "ci_high": b.ci_high, "ci_level": CI_LEVEL, "n": b.n,
            "n_pos": b.n_pos, "n_neg": b.n_neg, "n_concepts": b.n_strata, "n_bootstrap": n_bootstrap,
            "concept_aurocs": b.stratum_aurocs, "comparisons": "across_pairs", "auroc_with_twins": b.auroc_with_twins}


def lexical_fits(passages_by_concept: dict[str, Sequence[Passage]]) -> dict[str, LexicalFit]:
    """Each concept's lexical probe, fitted once on its train split for its baseline and every tier's."""
    return {concept: train_fit(passages) for concept, passages in passages_by_concept.items()}


def lexical_baselines(passages_by_concept: dict[str, Sequence[Passage]], *, n_bootstrap: int,
                      seed: int, fits: Mapping[str, LexicalFit] | None = None) -> list[LexicalBaselineRecord]:
    """One lexical baseline per concept, in the order given (`fits`: lexical_fits of these passages)."""
    return [lexical_record(concept, passages, n_bootstrap=n_bootstrap, seed=seed, ci_level=CI_LEVEL,
                           fit=None if fits is None else fits[concept])
            for concept, passages in passages_by_concept.items()]


def bucket_cells(records: Sequence[D1CellRecord]) -> dict[str, int]:
    """Strategy -> CV-chosen layer for the best strategy (mean held-out D1 there) and BUCKET_STRATEGIES."""
    layers = cv_chosen_layers([r.to_dict() for r in records])
    by_strategy: dict[str, list[float]] = {}
    for r in records:
        if r.probe == "logistic" and layers.get(r.strategy) == r.layer:
            by_strategy.setdefault(r.strategy, []).append(float(r.test_auroc))
    if not by_strategy:
        return {}
    best = min(by_strategy, key=lambda s: (-float(np.mean(by_strategy[s])), s))
    chosen = [best] + [s for s in BUCKET_STRATEGIES if s in by_strategy and s != best]
    return {s: layers[s] for s in chosen}


def d1_by_bucket(scores: pa.Table, passages_by_concept: dict[str, Sequence[Passage]],
                 records: Sequence[D1CellRecord], *, n_bootstrap: int, seed: int) -> list[BucketAurocRecord]:
    """Per chosen strategy and per density / placement bucket, the held-out AUROC over every concept's test
    passages from the stored held-out scores; empty when the corpus records no density and placement (v1, most
    user corpora)."""
    def placed(p: Passage) -> bool:
        return p.density is not None and p.placement is not None

    if not any(placed(p) for ps in passages_by_concept.values() for p in ps):
        return []
    cells = bucket_cells(records)
    columns = stored_heldout_columns(scores, passages_by_concept, cells, placed)
    return [BucketAurocRecord(strategy=strategy, layer=layer, probe="logistic", by=by, bucket=b.bucket,
                              **_subset_fields(b, n_bootstrap))
            for strategy, layer in cells.items() for by in BUCKET_FIELDS
            for b in columns[strategy].aurocs(lambda p, by=by: getattr(p, by), PLACEMENTS, n_bootstrap=n_bootstrap,
                                              seed=seed)]


def stored_heldout_columns(scores: pa.Table, passages_by_concept: dict[str, Sequence[Passage]],
                           cells: dict[str, int], keep: Callable[[Passage], bool]) -> dict[str, HeldoutColumns]:
    """Per strategy of `cells` (strategy -> layer): the held-out scores D1's logistic probe gave each concept's test
    passages that `keep` accepts, read from the run's per-passage score table: the numbers behind each cell's
    test_auroc, so a tier AUROC and the overall D1 come from one fit (a refit would not repeat a supervised
    strategy's per-fold heads or a learned aggregator's per-fold pooling)."""
    meta = {(c, p.id): p for c, ps in passages_by_concept.items() for p in ps}
    columns = {s: HeldoutColumns() for s in cells}
    for (concept, strategy), cell in held_out_cells(scores, cells, "logistic").items():
        col = columns[strategy]
        for pid, pair, label, score in zip(cell.passage_ids, cell.pair_ids, cell.labels, cell.scores, strict=True):
            passage = meta.get((concept, str(pid)))
            if passage is not None and keep(passage):
                col.scores.append(float(score))
                col.labels.append(int(label))
                col.groups.append(str(pair))
                col.concepts.append(concept)
                col.passages.append(passage)
    return columns


def has_tiers(passages_by_concept: dict[str, Sequence[Passage]]) -> bool:
    """Whether any test passage says its tier (the embedded corpus does; most user corpora do not)."""
    return any(p.tier is not None for ps in passages_by_concept.values() for p in ps if p.split == "test")


def d1_by_tier(scores: pa.Table, passages_by_concept: dict[str, Sequence[Passage]],
               records: Sequence[D1CellRecord], *, n_bootstrap: int, seed: int) -> list[TierAurocRecord]:
    """Per strategy and tier, the stratified held-out AUROC over every concept's test passages of that tier with a
    (concept, pair) bootstrap CI, from the stored held-out scores (`scores`: the run's per-passage score table);
    empty when no passage records a tier. Every strategy has one, supervised and learned ones included, so the
    declared tier estimand can rank a run of any strategies."""
    if not has_tiers(passages_by_concept):
        return []
    layers = cv_chosen_layers([r.to_dict() for r in records if r.probe == "logistic"], probe="logistic")
    cells = dict(sorted(layers.items()))
    columns = stored_heldout_columns(scores, passages_by_concept, cells, lambda p: p.tier is not None)
    return [TierAurocRecord(strategy=strategy, layer=layer, probe="logistic", tier=b.bucket,
                            **_subset_fields(b, n_bootstrap))
            for strategy, layer in cells.items()
            for b in columns[strategy].aurocs(lambda p: p.tier, TIERS, n_bootstrap=n_bootstrap, seed=seed)]


def lexical_by_tier(passages_by_concept: dict[str, Sequence[Passage]], *, n_bootstrap: int,
                    seed: int, fits: Mapping[str, LexicalFit] | None = None) -> list[LexicalTierRecord]:
    """Per concept and tier, the lexical baseline trained on the whole train split and scored on that tier's test
    passages (a tier with one class in test is skipped): one fit a concept (`fits`, or made here) for its tiers."""
    out = []
    for concept, passages in passages_by_concept.items():
        fit = fits[concept] if fits is not None else None
        for tier in TIERS:
            test = [p for p in passages if p.split == "test" and p.tier == tier]
            if len({p.label for p in test}) < 2:
                continue
            fit = fit if fit is not None else train_fit(passages)
            r = score_lexical(fit, [p.text for p in test], np.array([p.label for p in test]),
                              np.array([p.group for p in test]), n_bootstrap=n_bootstrap, ci_level=CI_LEVEL)
            out.append(LexicalTierRecord(concept=concept, tier=tier, test_auroc=r.test_auroc, ci_low=r.ci_low,
                                         ci_high=r.ci_high, ci_level=CI_LEVEL, n_test=r.n_test,
                                         n_bootstrap=n_bootstrap))
    return out
