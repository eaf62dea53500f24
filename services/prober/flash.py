"""Flash subsets (Perlitz et al. 2024): train on a small stratified, pair-preserving fraction and measure how
far the resulting strategy ranking can drift from the full one."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy.stats import kendalltau, rankdata

from poolbench.errors import PoolBenchError


class FlashError(PoolBenchError, ValueError):
    """A flash fraction the data cannot support, or a malformed fraction."""


def parse_fraction(text: str) -> Fraction:
    """'1/32' -> Fraction(1, 32); must lie in (0, 1]."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise FlashError(f"flash fraction {text!r} is not a fraction like 1/32") from None
    if not 0 < value <= 1:
        raise FlashError(f"flash fraction {text!r} must lie in (0, 1]")
    return value


def flash_subset(y: np.ndarray, groups: np.ndarray, fraction: float | Fraction, *, seed: int = 0,
                 concept: str = "?", min_per_class: int = 1) -> np.ndarray:
    """Sorted indices of a seeded fraction of the pair groups, taken per stratum of (positives, negatives).

    Every group of a stratum is equally likely; round(fraction * stratum size) groups are kept per stratum,
    so class balance and pairs survive. Fewer than `min_per_class` passages of a class left: FlashError.
    """
    y, groups = np.asarray(y), np.asarray(groups)
    fraction = Fraction(fraction).limit_denominator(10**6) if not isinstance(fraction, Fraction) else fraction
    if not 0 < fraction <= 1:
        raise FlashError(f"concept {concept}: flash fraction {fraction} must lie in (0, 1]")
    _, index = np.unique(groups, return_inverse=True)
    index = index.ravel()
    n_pos = np.bincount(index, weights=(y == 1))
    n_neg = np.bincount(index, weights=(y != 1))
    rng = np.random.default_rng(seed)
    keep = []
    for stratum in sorted(set(zip(n_pos.tolist(), n_neg.tolist(), strict=True))):
        members = np.flatnonzero((n_pos == stratum[0]) & (n_neg == stratum[1]))
        take = int(Fraction(members.size) * fraction + Fraction(1, 2))
        keep.extend(rng.permutation(members)[:take].tolist())
    rows = np.flatnonzero(np.isin(index, keep))
    pos, neg = int(np.sum(y[rows] == 1)), int(np.sum(y[rows] != 1))
    if min(pos, neg) < min_per_class:
        raise FlashError(f"concept {concept}: flash fraction {fraction} of {y.size} train passages leaves "
                         f"{pos} pos / {neg} neg; needs >= {min_per_class} per class")
    return rows


def ranking(scores: np.ndarray) -> np.ndarray:
    """Rank of each strategy (1 = best) by mean score over units [n_units, k]; ties averaged."""
    return rankdata(-np.nanmean(scores, axis=0))


@dataclass(frozen=True)
class RankResolution:
    """Per strategy, the 95% interval of (flash rank - full rank) over bootstrap resamples of units."""

    low: np.ndarray
    high: np.ndarray
    resolution: float  # max over strategies of the interval's largest |end|
    kendall_tau: float  # between the full and flash rankings on all units


def rank_resolution(full: np.ndarray, flash: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0,
                    level: float = 0.95) -> RankResolution:
    """How many places a flash ranking can be off: full and flash scores [n_units, k] on the same units."""
    full, flash = np.asarray(full, dtype=np.float64), np.asarray(flash, dtype=np.float64)
    if full.shape != flash.shape or full.ndim != 2 or full.shape[1] < 2:
        raise FlashError(f"rank resolution: full {full.shape} and flash {flash.shape} must be [units, >=2]")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, full.shape[0], size=(n_bootstrap, full.shape[0]))
    diffs = np.array([ranking(flash[d]) - ranking(full[d]) for d in draws])
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail], axis=0)
    tau = kendalltau(ranking(full), ranking(flash)).statistic
    return RankResolution(low=low, high=high, resolution=float(np.max(np.maximum(np.abs(low), np.abs(high)))),
                          kendall_tau=float(tau))
