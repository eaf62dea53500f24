"""BucketAurocRecord: held-out D1 of one (strategy, layer) cell restricted to passages of one density or placement."""

from __future__ import annotations

from poolbench.records.base import Number, Record


class BucketAurocRecord(Record):
    """AUROC over the test passages of one bucket (`by` = density or placement), positives compared with negatives
    of the same concept only and never with their own twin (`comparisons` = "across_pairs"; absent in older runs,
    which counted twins); `concept_aurocs` gives each concept's own, None where no comparison is left."""

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
    comparisons: str | None = None
    auroc_with_twins: Number | None = None  # the same bucket counting each positive against its own twin too
