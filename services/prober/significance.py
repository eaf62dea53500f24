"""Is a difference between strategies real? Friedman + Nemenyi over many cells; paired bootstrap and
DeLong's test, matched pairs as clusters, between two strategies' scores on the same test passages of one cell."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import friedmanchisquare, norm, rankdata, studentized_range

from poolbench.prober.auroc import (
    ProbeError,
    _check_scores_labels,
    auroc_batch,
    clustered_auroc_covariance,
    group_bootstrap_weights,
)

PAIRED_DELONG_METHOD = "pair_clustered_delong"


def nemenyi_critical_difference(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """(q_alpha, CD): two average ranks differ significantly when apart by more than CD (Demšar 2006)."""
    q = float(studentized_range.ppf(1.0 - alpha, k, np.inf) / math.sqrt(2.0))
    return q, q * math.sqrt(k * (k + 1) / (6.0 * n))


def friedman_nemenyi(scores: np.ndarray, strategies: Sequence[str], alpha: float = 0.05) -> dict:
    """Friedman's test over [n_units, k] scores (higher = better) and the data of a critical-difference plot.

    Ranks are 1 = best within each unit, ties averaged; `average_ranks` with `critical_difference` draw the
    diagram.
    """
    scores = np.asarray(scores, dtype=np.float64)
    n, k = scores.shape
    if k != len(strategies) or k < 3 or n < 2 or np.isnan(scores).any():
        raise ProbeError(f"Friedman: needs >= 3 strategies and >= 2 complete units, got {n} x {k}")
    statistic, p_value = friedmanchisquare(*scores.T)
    ranks = rankdata(-scores, axis=1).mean(axis=0)
    q, cd = nemenyi_critical_difference(k, n, alpha)
    return {"statistic": float(statistic), "p_value": float(p_value), "n_units": n, "k": k, "alpha": alpha,
            "q_alpha": q, "critical_difference": cd,
            "average_ranks": {s: float(r) for s, r in zip(strategies, ranks, strict=True)}}


@dataclass(frozen=True)
class PairedAUROC:
    """AUROC(a) - AUROC(b) on the same passages, its CI and two-sided p-value."""

    auroc_a: float
    auroc_b: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    method: str


def paired_bootstrap_auroc(scores_a: np.ndarray, scores_b: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                           *, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> PairedAUROC:
    """Both strategies scored on the same pair-level resamples (one weight matrix), so the CI is paired.

    p is twice the smaller share of resampled differences on either side of 0 (at least 1/n_bootstrap).
    """
    a, pos = _check_scores_labels(scores_a, labels)
    b, _ = _check_scores_labels(scores_b, labels)
    weights = group_bootstrap_weights(np.asarray(groups), pos, n_bootstrap, seed)
    ones = np.ones((1, pos.size))
    auc_a, auc_b = float(auroc_batch(a, pos, ones)[0]), float(auroc_batch(b, pos, ones)[0])
    diffs = auroc_batch(a, pos, weights) - auroc_batch(b, pos, weights)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    p = min(1.0, 2.0 * max(min(np.mean(diffs <= 0), np.mean(diffs >= 0)), 1.0 / n_bootstrap))
    return PairedAUROC(auc_a, auc_b, auc_a - auc_b, float(low), float(high), float(p), "paired_bootstrap")


def _midranks(x: np.ndarray) -> np.ndarray:
    return rankdata(x, method="average", axis=-1)


def delong_covariance(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(AUROCs [k], covariance [k, k]) of k score vectors on one set of passages, passages independent: fast DeLong
    (Sun & Xu 2014). The unclustered reference the tests hold delong_test's clustered covariance against.

    Midranks within positives, within negatives and over all give the structural components in O(n log n).
    """
    scores = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    pos = np.asarray(labels).astype(bool)
    m, n = int(pos.sum()), int((~pos).sum())
    if m < 2 or n < 2:
        raise ProbeError(f"DeLong: needs >= 2 passages per class, got {m} pos and {n} neg")
    x, y = scores[:, pos], scores[:, ~pos]
    tx, ty, tz = _midranks(x), _midranks(y), _midranks(np.concatenate([x, y], axis=1))
    aucs = (tz[:, :m].sum(axis=1) - m * (m + 1) / 2.0) / (m * n)
    v01 = (tz[:, :m] - tx) / n
    v10 = 1.0 - (tz[:, m:] - ty) / m
    cov = np.atleast_2d(np.cov(v01)) / m + np.atleast_2d(np.cov(v10)) / n
    return aucs, cov


def delong_test(scores_a: np.ndarray, scores_b: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                level: float = 0.95) -> PairedAUROC:
    """DeLong's paired test of AUROC(a) = AUROC(b) with matched pairs as clusters, normal CI and p.

    Var(A_a - A_b) = Var_a + Var_b - 2 Cov_ab from clustered_auroc_covariance (Obuchowski 1997), the estimator
    D1's own CIs use: twins share their content, so treating them as independent passages understates the variance
    whenever a strategy's advantage differs from pair to pair (tests/test_significance.py). Singleton groups give
    DeLong's unclustered test (up to the K/(K-1) factor).
    """
    a, pos = _check_scores_labels(scores_a, labels)
    b, _ = _check_scores_labels(scores_b, labels)
    aucs, cov = clustered_auroc_covariance(np.vstack([a, b]), pos, groups)
    diff = float(aucs[0] - aucs[1])
    var = float(cov[0, 0] + cov[1, 1] - 2.0 * cov[0, 1])
    se = math.sqrt(max(var, 0.0))
    z = norm.ppf(0.5 + level / 2.0)
    p = (1.0 if diff == 0.0 else 0.0) if se == 0.0 else float(2.0 * norm.sf(abs(diff) / se))
    return PairedAUROC(float(aucs[0]), float(aucs[1]), diff, diff - z * se, diff + z * se, p, PAIRED_DELONG_METHOD)
