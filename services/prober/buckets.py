"""D1 by bucket (density, placement): held-out probe scores split by where and how densely the concept appears.

Each concept has its own probe, so scores of two concepts share no scale: a bucket's AUROC compares positives only
with negatives of the same concept (a stratified Mann-Whitney, the per-concept AUROCs weighted by n_pos * n_neg),
and its CI resamples (concept, matched pair) units. A positive is never compared with its own twin: the twin
shares its content and differs only in the concept, so twin-vs-twin comparisons (a third to a half of a bucket's
on the default corpus) measure something else than ranking passages across content; `auroc_with_twins` keeps the
all-comparisons value, labelled. Arrays in, numbers out.
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


def _same_group_comparisons(scores: np.ndarray, labels: np.ndarray, strata: np.ndarray,
                            groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positive index, negative index, 1 / 0.5 / 0 ordered right) of every same-stratum, same-group comparison:
    (stratum, group) keys in sorted order, within a key each positive (ascending) against every negative
    (ascending). The order is the sums' order downstream (a matrix-vector product), so it is the one a loop over
    the sorted keys gives, built here without a Python loop (a full-corpus tier holds ~1,700 keys, and the answer's
    breakdowns ask ~1,400 times)."""
    keys = np.char.add(np.char.add(strata.astype(str), "\x00"), groups.astype(str))
    if keys.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    key_index = np.unique(keys, return_inverse=True)[1].ravel()
    by_key = np.argsort(key_index, kind="stable")  # rows grouped by sorted key, ascending within a key
    pos_rows, neg_rows = by_key[labels[by_key]], by_key[~labels[by_key]]
    pos_key = key_index[pos_rows]
    neg_count = np.bincount(key_index[neg_rows], minlength=int(key_index.max()) + 1)
    neg_start = np.cumsum(neg_count) - neg_count
    reps = neg_count[pos_key]
    i = np.repeat(pos_rows, reps).astype(np.int64)
    within = np.arange(i.size) - np.repeat(np.cumsum(reps) - reps, reps)
    j = neg_rows[np.repeat(neg_start[pos_key], reps) + within].astype(np.int64)
    return i, j, (scores[i] > scores[j]) + 0.5 * (scores[i] == scores[j])


def stratified_auroc_batch(scores: np.ndarray, labels: np.ndarray, strata: np.ndarray,
                           weights: np.ndarray, groups: np.ndarray | None = None) -> np.ndarray:
    """Per weight row, the share of same-stratum (positive, negative) comparisons ordered right, i.e.
    sum_c AUROC_c * P_c * N_c / sum_c P_c * N_c (P, N the weighted class counts); with `groups`, comparisons
    within one group (a positive and its own twin) are left out. NaN where no comparison is left."""
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
    if groups is not None:
        i, j, right = _same_group_comparisons(scores, labels, strata, np.asarray(groups))
        both = weights[:, i] * weights[:, j]
        numerator -= both @ right
        denominator -= both.sum(axis=1)
        denominator = np.where(denominator > 1e-9, denominator, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)


@dataclass(frozen=True)
class BucketAuroc:
    """One bucket's stratified AUROC across matched pairs, its CI (None when no comparison is left) and counts;
    `auroc_with_twins` also counts each positive against its own twin (the pre-v2 number)."""

    bucket: str
    auroc: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    n_pos: int
    n_neg: int
    n_strata: int
    stratum_aurocs: dict[str, float | None]
    auroc_with_twins: float | None = None


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
        g = groups[rows]
        per = {str(c): _single(s[st == c], y[st == c], g[st == c]) for c in sorted(set(st.tolist()))}
        ones = np.ones((1, s.size))
        value = float(stratified_auroc_batch(s, y, st, ones, g)[0])
        with_twins = float(stratified_auroc_batch(s, y, st, ones)[0])
        low = high = None
        if np.isfinite(value):
            units = np.char.add(np.char.add(st, "\x00"), g)
            reps = stratified_auroc_batch(s, y, st, group_bootstrap_weights(units, y, n_bootstrap, seed), g)
            lo, hi = np.nanquantile(reps, [alpha, 1.0 - alpha])
            low, high = float(lo), float(hi)
        out.append(BucketAuroc(bucket=bucket, auroc=value if np.isfinite(value) else None, ci_low=low, ci_high=high,
                               n=int(rows.sum()), n_pos=int(y.sum()), n_neg=int((~y).sum()),
                               n_strata=len(per), stratum_aurocs=per,
                               auroc_with_twins=with_twins if np.isfinite(with_twins) else None))
    return out


def _single(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float | None:
    value = stratified_auroc_batch(scores, labels, np.zeros(scores.size), np.ones((1, scores.size)), groups)[0]
    return float(value) if np.isfinite(value) else None
