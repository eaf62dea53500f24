"""ScorerValidity: a classifier B's held-out validity, one record per concept in results.json."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class ScorerValidity(Record):
    """What a reader needs to trust (or refuse) a concept's scorer; None where an old stored scorer is silent."""

    concept: str
    encoder: str | None
    encoder_hash: str | None
    fine_tuned: str | None
    trained_params: int | None
    total_params: int | None
    n_train: int | None
    n_heldout: int | None
    heldout_accuracy: Number | None
    heldout_auroc: Number | None
    heldout_auroc_ci_low: Number | None
    heldout_auroc_ci_high: Number | None
    valid: bool | None
    train_seconds: Number | None
    key: str | None
    min_auroc: Number
