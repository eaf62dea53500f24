"""Weighted AUROC as a Mann-Whitney statistic, batched over weight vectors; its pair-level bootstrap; and D1's CI.

Scores are fixed across bootstrap resamples and only the weights change, so one sort serves every
resample: 1,000 AUROCs are a handful of [n_boot, n_ties] array operations, not 1,000 calls. D1's interval is
not the bootstrap's: at 8 test pairs a percentile pair bootstrap covered a known AUROC of 0.9 in 78-80% of
simulated cells and printed [1, 1] for every separated one; `auroc_ci` (pair-clustered DeLong on the logit scale,
Wilson at perfect separation) covers >= 93% at 8 and at 300 pairs (tests/test_coverage.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import expit
from scipy.stats import norm, rankdata

from poolbench.errors import PoolBenchError
from poolbench.prober.array_memo import ArrayMemo
from poolbench.store.keys import sha256_bytes

_MAX_REDRAW_ROUNDS = 100
# A full-corpus run's tier resamples are ~27 MB each (1,000 x ~3,400 passages, three tiers), the answer's ~5 MB a
# concept (17): one stage's draws fit.
_WEIGHTS = ArrayMemo(max_bytes=256 * 2**20)


class ProbeError(PoolBenchError, ValueError):
    """Probe inputs the D1 metric cannot be computed on (too few passages, one class, non-finite values)."""


def _check_scores_labels(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    if scores.ndim != 1 or labels.shape != scores.shape:
        raise ProbeError(f"auroc: scores {scores.shape} and labels {labels.shape} must be 1-D of one length")
    if not np.all(np.isfinite(scores)):
        raise ProbeError(f"auroc: {int(np.sum(~np.isfinite(scores)))} of {scores.size} scores are not finite")
    if not np.all(np.isin(labels, (0, 1))):
        raise ProbeError(f"auroc: labels must be 0/1, got values {np.unique(labels)[:5].tolist()}")
    return scores, labels.astype(bool)


def auroc_batch(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC of one score vector under each row of `weights` [n_rows, n]; ties count one half.

    AUC = sum over tie blocks t of P_t * (N_below_t + N_t / 2) / (P_total * N_total), with P/N the
    summed positive/negative weights; rows whose P_total or N_total is zero give NaN.
    """
    scores, pos = _check_scores_labels(scores, labels)
    weights = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    if weights.shape[1] != scores.size:
        raise ProbeError(f"auroc: weights have {weights.shape[1]} columns for {scores.size} scores")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ProbeError("auroc: weights must be finite and non-negative")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    block_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    w_sorted = weights[:, order]
    pos_sorted = pos[order]
    p_blocks = np.where(pos_sorted, w_sorted, 0.0)
    n_blocks = np.where(pos_sorted, 0.0, w_sorted)
    if block_starts.size < scores.size:  # tied scores: one block each (without ties every block is one column)
        p_blocks = np.add.reduceat(p_blocks, block_starts, axis=1)
        n_blocks = np.add.reduceat(n_blocks, block_starts, axis=1)
    n_below = np.cumsum(n_blocks, axis=1) - n_blocks
    numerator = np.sum(p_blocks * (n_below + 0.5 * n_blocks), axis=1)
    denominator = p_blocks.sum(axis=1) * n_blocks.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0), np.nan)


def auroc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Area under the ROC curve, equal to sklearn's roc_auc_score(labels, scores, sample_weight=weights)."""
    scores = np.asarray(scores, dtype=np.float64)
    w = np.ones_like(scores) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != scores.shape:
        raise ProbeError(f"auroc: weights shape {w.shape} differs from scores shape {scores.shape}")
    value = auroc_batch(scores, labels, w[None, :])[0]
    if np.isnan(value):
        raise ProbeError("auroc: needs positive weight on both classes, got one class only")
    return float(value)


def group_bootstrap_weights(
    groups: np.ndarray, labels: np.ndarray, n_bootstrap: int, seed: int
) -> np.ndarray:
    """Per-passage weights [n_bootstrap, n]: each row resamples whole groups with replacement.

    A passage's weight is how many times its group was drawn, so a matched pair always enters a
    resample together. Rows that draw one class only are redrawn (not skipped), so every row is a
    valid resample and the CI always rests on exactly `n_bootstrap` AUROCs.

    The array is read-only and may be shared: a run's breakdowns resample the same passages once per strategy (D1
    by tier: every strategy's held-out scores on one tier's passages; the answer's paired bootstrap: each concept's
    pairs against every other strategy), and the draws depend only on the groups' partition, the labels, the count
    and the seed, so they are drawn once (_WEIGHTS) and every later call gets the same bits.
    """
    labels = np.asarray(labels).astype(bool)
    _, group_index = np.unique(np.asarray(groups), return_inverse=True)
    group_index = group_index.ravel()
    # group_index is n int64s, labels n bools: their bytes joined are unambiguous.
    return _WEIGHTS.get((sha256_bytes(group_index.astype(np.int64).tobytes() + labels.tobytes()), int(n_bootstrap),
                         int(seed)),
                        lambda: _draw_group_weights(group_index, labels, n_bootstrap, seed))


def _draw_group_weights(group_index: np.ndarray, labels: np.ndarray, n_bootstrap: int, seed: int) -> np.ndarray:
    n_groups = int(group_index.max()) + 1
    has_pos = np.zeros(n_groups, dtype=bool)
    has_neg = np.zeros(n_groups, dtype=bool)
    has_pos[group_index[labels]] = True
    has_neg[group_index[~labels]] = True
    if not has_pos.any() or not has_neg.any():
        raise ProbeError("bootstrap: labels hold one class only; AUROC needs both")
    rng = np.random.default_rng(seed)
    probs = np.full(n_groups, 1.0 / n_groups)
    counts = rng.multinomial(n_groups, probs, size=n_bootstrap)
    for _ in range(_MAX_REDRAW_ROUNDS):
        bad = ((counts @ has_pos) == 0) | ((counts @ has_neg) == 0)
        if not bad.any():
            break
        counts[bad] = rng.multinomial(n_groups, probs, size=int(bad.sum()))
    else:
        raise ProbeError(
            f"bootstrap: resamples kept drawing one class only after {_MAX_REDRAW_ROUNDS} redraws "
            f"({int(has_pos.sum())} groups with a positive, {int(has_neg.sum())} with a negative)"
        )
    weights = counts.astype(np.float64)[:, group_index]
    weights.flags.writeable = False
    return weights


def bootstrap_aurocs(
    scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, n_bootstrap: int = 1000, seed: int = 0
) -> np.ndarray:
    """The `n_bootstrap` AUROCs of group-level resamples of (scores, labels), computed in one batch."""
    scores, pos = _check_scores_labels(scores, labels)
    groups = np.asarray(groups)
    if groups.shape != scores.shape:
        raise ProbeError(f"bootstrap: groups shape {groups.shape} differs from scores shape {scores.shape}")
    if n_bootstrap < 1:
        raise ProbeError(f"bootstrap: n_bootstrap must be >= 1, got {n_bootstrap}")
    weights = group_bootstrap_weights(groups, pos, n_bootstrap, seed)
    return auroc_batch(scores, pos, weights)


def bootstrap_auroc_ci(
    scores: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    n_bootstrap: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile CI of the AUROC from resampling groups, so a matched pair counts as one unit.

    Passages of a pair share their content and differ only in the concept, so they are not
    independent draws; resampling passages singly would understate the AUROC's variance.
    """
    if not 0.0 < level < 1.0:
        raise ProbeError(f"bootstrap: level must lie in (0, 1), got {level}")
    values = bootstrap_aurocs(scores, labels, groups, n_bootstrap, seed)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(values, [alpha, 1.0 - alpha])
    return float(low), float(high)


# Which interval D1's test AUROC carries (records' ci_method); chosen by the coverage study in tests/test_coverage.py.
AUROC_CI_METHOD = "pair_clustered_delong_logit"


def clustered_auroc_covariance(scores: np.ndarray, labels: np.ndarray,
                               groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(AUROCs [k], covariance [k, k]) of k score rows on one set of passages, matched pairs as clusters:
    Obuchowski's (1997) clustered DeLong estimator, for one AUROC or for two paired ones.

    Each passage's placement (share of the other class it out-ranks) is summed per cluster, so the two twins of
    a pair, which share their content, enter the (co)variance as one unit rather than two independent draws:
    with u_g = (sum of positive placements - m_g A)/m + (sum of negative placements - n_g A)/n per cluster g of K,
    Cov = K/(K-1) * sum_g u_g u_g^T.
    """
    scores = np.atleast_2d(np.asarray(scores, dtype=np.float64))
    rows = [_check_scores_labels(row, labels)[0] for row in scores]
    pos = _check_scores_labels(rows[0], labels)[1]
    groups = np.asarray(groups)
    if groups.shape != pos.shape:
        raise ProbeError(f"AUROC CI: groups shape {groups.shape} differs from scores shape {pos.shape}")
    m, n = int(pos.sum()), int((~pos).sum())
    if m == 0 or n == 0:
        raise ProbeError("AUROC CI: labels hold one class only; AUROC needs both")
    _, cluster = np.unique(groups, return_inverse=True)
    cluster = cluster.ravel()
    k = int(cluster.max()) + 1
    if k < 2:
        raise ProbeError("AUROC CI: needs >= 2 pair groups for a clustered variance")
    values, components = [], []
    for row in rows:
        every = rankdata(row)
        v10 = (every[pos] - rankdata(row[pos])) / n  # per positive: share of negatives below (ties half)
        v01 = 1.0 - (every[~pos] - rankdata(row[~pos])) / m  # per negative: share of positives above
        value = float(v10.mean())
        r10 = np.bincount(cluster[pos], v10, k) - np.bincount(cluster[pos], minlength=k) * value
        r01 = np.bincount(cluster[~pos], v01, k) - np.bincount(cluster[~pos], minlength=k) * value
        values.append(value)
        components.append(r10 / m + r01 / n)
    u = np.vstack(components)  # [n_rows, K]
    return np.asarray(values), k / (k - 1) * (u @ u.T)


def clustered_auroc_variance(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> tuple[float, float]:
    """(AUROC, its variance) with matched pairs as clusters (clustered_auroc_covariance of one score row)."""
    scores, _ = _check_scores_labels(scores, labels)
    values, cov = clustered_auroc_covariance(scores[None, :], labels, groups)
    return float(values[0]), float(max(cov[0, 0], 0.0))


def wilson_interval(p: float, n: float, level: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion p observed on n (effective) units; never [p, p] at p in {0, 1}."""
    z = float(norm.ppf(0.5 + level / 2.0))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class AurocInterval:
    """An AUROC's CI; `degenerate` says the scores separate the classes, so no variance was observed and the
    interval rests on the worst-case bound Var <= A(1-A)/min(n_pos, n_neg) (Birnbaum & Klose 1957) instead."""

    low: float
    high: float
    method: str
    degenerate: bool


def auroc_ci(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, level: float = 0.95) -> AurocInterval:
    """CI of the AUROC with matched pairs as clusters: clustered DeLong variance on the logit scale.

    At perfect separation (AUROC 0 or 1, zero observed variance) a Wilson interval on min(n_pos, n_neg) units
    replaces it, so 8 separated test pairs give [0.68, 1], not the certainty [1, 1] a bootstrap prints.
    """
    if not 0.0 < level < 1.0:
        raise ProbeError(f"AUROC CI: level must lie in (0, 1), got {level}")
    value, var = clustered_auroc_variance(scores, labels, groups)
    pos = np.asarray(labels).astype(bool)
    if 0.0 < value < 1.0 and var > 0.0:
        z = float(norm.ppf(0.5 + level / 2.0))
        centre = math.log(value / (1.0 - value))
        half = z * math.sqrt(var) / (value * (1.0 - value))
        low, high = float(expit(centre - half)), float(expit(centre + half))
        return AurocInterval(low, high, AUROC_CI_METHOD, degenerate=False)
    low, high = wilson_interval(value, float(min(pos.sum(), (~pos).sum())), level)
    return AurocInterval(low, high, AUROC_CI_METHOD, degenerate=True)
