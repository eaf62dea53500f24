"""Per-tier readings of a run: D1 of a strategy over one tier's test passages, and the lexical baseline per tier."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class TierAurocRecord(Record):
    """Held-out AUROC of one (strategy, layer) cell over the test passages of one tier (standard or hard), positives
    compared with negatives of the same concept only; `concept_aurocs` gives each concept's own."""

    strategy: str
    layer: int
    probe: str
    tier: str
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
