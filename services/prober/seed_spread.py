"""D1's cross-validated AUROC over several seeds: how much of a score is the luck of the fold shuffle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator

from poolbench.prober.auroc import ProbeError, auroc
from poolbench.prober.fast_folds import stratified_group_splits as cv_splits
from poolbench.prober.probes import make_logistic_probe

ProbeFactory = Callable[[int], BaseEstimator]
Splits = list[tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class SeedSpread:
    """Per-seed CV AUROC (seed i shuffles the folds and seeds the probe), their mean and sample σ (ddof=1)."""

    seeds: tuple[int, ...]
    cv_aurocs: np.ndarray
    mean: float
    std: float


def fold_auroc(X: np.ndarray, y: np.ndarray, splits: Splits, probe: ProbeFactory, seed: int) -> float:
    """Mean over folds of the held-out fold AUROC, as d1.cv_auroc: each fold's probe fitted from scratch."""
    values = np.empty(len(splits))
    for k, (fit_idx, val_idx) in enumerate(splits):
        if np.unique(y[val_idx]).size < 2 or np.unique(y[fit_idx]).size < 2:
            raise ProbeError(f"CV fold {k} holds one class only; the pair groups are too lopsided")
        model = probe(seed).fit(X[fit_idx], y[fit_idx])
        values[k] = auroc(np.asarray(model.decision_function(X[val_idx]), dtype=np.float64), y[val_idx])
    return float(values.mean())


def seed_spread(X: np.ndarray, y: np.ndarray, groups: np.ndarray, *, seed: int = 0, n_seeds: int = 5,
                n_folds: int = 5, probe: ProbeFactory = make_logistic_probe,
                first: float | None = None) -> SeedSpread:
    """CV AUROC for seeds seed, seed+1, ..., seed+n_seeds-1; seed `seed` reproduces D1's cv_auroc folds.

    D1's probe is the same estimator fitted the same way, so seed `seed` equals D1's cv_auroc exactly. A convex
    probe is seed-invariant, so the spread lives in the fold assignment. `first` is that value when the caller
    already has it (D1 computed it on these folds): its five fits are not run twice.
    """
    if n_seeds < 2:
        raise ProbeError(f"seed spread needs n_seeds >= 2, got {n_seeds}")
    seeds = tuple(seed + k for k in range(n_seeds))
    values = np.array([first if (s == seed and first is not None)
                       else fold_auroc(X, y, cv_splits(y, groups, n_folds, s), probe, s) for s in seeds])
    return SeedSpread(seeds=seeds, cv_aurocs=values, mean=float(values.mean()), std=float(values.std(ddof=1)))
