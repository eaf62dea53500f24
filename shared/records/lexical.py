"""LexicalBaselineRecord: per concept, how far a bag of words alone separates the classes (train -> test)."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class LexicalBaselineRecord(Record):
    """TF-IDF + logistic held-out AUROC of one concept with its pair-bootstrap CI: the share of a concept that is
    vocabulary, to read each strategy's D1 against."""

    concept: str
    test_auroc: Number
    ci_low: Number
    ci_high: Number
    ci_level: Number
    n_train: int
    n_test: int
    n_bootstrap: int
    n_features: int
    C: Number
    features: str
    ci_method: str | None = None  # absent: older runs, a pair-bootstrap percentile interval
    ci_degenerate: bool | None = None
