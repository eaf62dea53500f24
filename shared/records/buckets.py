"""BucketAurocRecord: held-out D1 of one (strategy, layer) cell restricted to passages of one density or placement."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class BucketAurocRecord(Record):
    """AUROC over the test passages of one bucket (`by` = density or placement), positives compared with negatives
    of the same concept only; `concept_aurocs` gives each concept's own, None where the bucket holds one class."""

    strategy: str
    layer: int
    probe: str
    by: str
    bucket: str
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
