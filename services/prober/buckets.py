"""D1 by bucket (density, placement): held-out probe scores split by where and how densely the concept appears.

Each concept has its own probe, so scores of two concepts share no scale: a bucket's AUROC compares positives only
with negatives of the same concept (a stratified Mann-Whitney, the per-concept AUROCs weighted by n_pos * n_neg),
and its CI resamples (concept, matched pair) units. Arrays in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poolbench.prober.auroc import ProbeError, auroc_batch, group_bootstrap_weights
from poolbench.prober.probes import make_probe


def heldout_scores(X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, seed: int = 0) -> np.ndarray:
    """Decision scores of D1's logistic probe fitted on the whole train split: the scores behind D1's test AUROC."""
    model = make_probe("logistic", seed).fit(X_train, y_train)
    return np.asarray(model.decision_function(X_test), dtype=np.float64)


def stratified_auroc_batch(scores: np.ndarray, labels: np.ndarray, strata: np.ndarray,
                           weights: np.ndarray) -> np.ndarray:
    """Per weight row, sum_c AUROC_c * P_c * N_c / sum_c P_c * N_c over strata c (P, N the weighted class counts):
    the share of same-stratum (positive, negative) pairs ordered right. NaN where no stratum has both classes."""
    scores, labels, strata = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool), np.asarray(strata)
    weights = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    numerator = np.zeros(weights.shape[0])
    denominator = np.zeros(weights.shape[0])
    for stratum in np.unique(strata):
        rows = strata == stratum
        w = weights[:, rows]
        pairs = w[:, labels[rows]].sum(axis=1) * w[:, ~labels[rows]].sum(axis=1)
        if not pairs.any():
            continue
        value = auroc_batch(scores[rows], labels[rows], w)
        numerator += np.where(pairs > 0, np.nan_to_num(value) * pairs, 0.0)
        denominator += pairs
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)


@dataclass(frozen=True)
class BucketAuroc:
    """One bucket's stratified AUROC, its CI (None when it has no pair of a positive and a negative) and counts."""

    bucket: str
    auroc: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    n_pos: int
    n_neg: int
    n_strata: int
    stratum_aurocs: dict[str, float | None]


def bucket_aurocs(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, strata: np.ndarray,
                  buckets: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0, ci_level: float = 0.95,
                  order: Sequence[str] = ()) -> list[BucketAuroc]:
    """Per bucket value (those in `order` first, in that order; the rest numeric, then alphabetical), the stratified
    AUROC of `scores` and a CI from resampling (stratum, group) units; `groups` are matched-pair ids."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    groups, strata, buckets = (np.asarray(groups).astype(str), np.asarray(strata).astype(str),
                               np.asarray(buckets).astype(str))
    if not scores.shape == labels.shape == groups.shape == strata.shape == buckets.shape or scores.ndim != 1:
        raise ProbeError("bucket AUROC: scores, labels, groups, strata and buckets must be 1-D of one length")
    alpha = (1.0 - ci_level) / 2.0
    out = []
    rank = {b: i for i, b in enumerate(order)}
    for bucket in sorted(set(buckets.tolist()), key=lambda b: (rank.get(b, len(rank)), len(b), b)):
        rows = buckets == bucket
        s, y, st = scores[rows], labels[rows], strata[rows]
        per = {str(c): _single(s[st == c], y[st == c]) for c in sorted(set(st.tolist()))}
        value = float(stratified_auroc_batch(s, y, st, np.ones((1, s.size)))[0])
        low = high = None
        if np.isfinite(value):
            units = np.char.add(np.char.add(st, "\x00"), groups[rows])
            reps = stratified_auroc_batch(s, y, st, group_bootstrap_weights(units, y, n_bootstrap, seed))
            lo, hi = np.nanquantile(reps, [alpha, 1.0 - alpha])
            low, high = float(lo), float(hi)
        out.append(BucketAuroc(bucket=bucket, auroc=value if np.isfinite(value) else None, ci_low=low, ci_high=high,
                               n=int(rows.sum()), n_pos=int(y.sum()), n_neg=int((~y).sum()),
                               n_strata=len(per), stratum_aurocs=per))
    return out


def _single(scores: np.ndarray, labels: np.ndarray) -> float | None:
    if labels.all() or not labels.any():
        return None
    return float(auroc_batch(scores, labels, np.ones((1, scores.size)))[0])
