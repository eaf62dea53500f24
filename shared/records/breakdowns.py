"""Readings of D1 on a subset of the test passages (a density or placement bucket, a corpus tier) and the lexical
baseline per tier: the records results.json carries beside the D1 cells."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class SubsetAurocRecord(Record):
    """Held-out AUROC of one (strategy, layer) cell over a subset of the test passages, positives compared with
    negatives of the same concept only and never with their own twin (`comparisons` = "across_pairs"; absent in
    older runs, which counted twins); `auroc_with_twins` counts each positive against its own twin too, and
    `concept_aurocs` gives each concept's own, None where no comparison is left."""

    strategy: str
    layer: int
    probe: str
    auroc: Number | None
    ci_low: Number | None
    ci_high: Number | None
    ci_level: Number
    n: int
    n_pos: int
    n_neg: int
    n_concepts: int
    n_bootstrap: int
    concept_aurocs: dict[str, Number | None]
    comparisons: str | None = None
    auroc_with_twins: Number | None = None


class BucketAurocRecord(SubsetAurocRecord):
    """The subset is one bucket of `by` (density or placement)."""

    by: str
    bucket: str


class TierAurocRecord(SubsetAurocRecord):
    """The subset is one corpus tier (standard or hard); on the hard tier a pair's two passages share their words,
    so `auroc_with_twins` includes the comparisons the words cannot make."""

    tier: str


class LexicalTierRecord(Record):
    """The lexical baseline (trained on the whole train split) scored on one tier of one concept's test split: the
    hard tier is built so that words alone cannot separate it."""

    concept: str
    tier: str
    test_auroc: Number
    ci_low: Number
    ci_high: Number
    ci_level: Number
    n_test: int
    n_bootstrap: int
