"""Selectivity (Hewitt & Liang 2019): the probe's score on the concept minus its score on a control task.

H&L's control task gives every word TYPE a random label; a probe can reach it only by memorising the
type -> label map, which works because tokens of one type recur between training and evaluation. Its score
is the probe's capacity to memorise surface content, and selectivity is how far the concept lifts the probe
above that capacity. A PoolBench passage's recurring type is its lexical type (its domain: each concept spans
several, each with its own vocabulary), which recurs across matched pairs. So the control gives every passage of
one type one random label (fixed by the type and the seed, balance kept), and the folds keep each matched pair
together, as the concept task's do: a held-out passage's twin is never in the probe's training set, so the probe
cannot recognise the twin (v2's control dealt twins into different folds and scored 1.0 on nearly every cell),
only the type, through other pairs. A representation that encodes the concept and not the content scores a control
near 0.5 and a high selectivity; one that carries the content (type) scores a high control and a low selectivity.
Without types that recur across pairs nothing can be memorised, so selectivity is n/a with the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from poolbench.prober.auroc import ProbeError, auroc, auroc_ci
from poolbench.prober.fast_folds import stratified_group_splits as cv_splits
from poolbench.prober.probes import make_logistic_probe
from poolbench.prober.seed_spread import ProbeFactory, Splits, fold_auroc

CONTROL_TASK = "lexical type (domain) -> random label, pair-grouped folds"


@dataclass(frozen=True)
class Selectivity:
    """S = true - control, the control's CV AUROC with a CI, or None with `na_reason` when no control is meaningful."""

    true_score: float
    control_score: float | None
    selectivity: float | None
    control_ci_low: float | None = None
    control_ci_high: float | None = None
    na_reason: str | None = None


def unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (key, seed) across processes and Python versions (not hash())."""
    digest = hashlib.blake2b(f"{seed}\x1f{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def control_labels(types: np.ndarray, seed: int) -> np.ndarray:
    """0/1 control labels, one per type: types in order of unit_hash(type, seed) are labelled 1 while the count of
    control positives stays <= half the passages (the first type always), so both classes appear when >= 2 types."""
    types = np.asarray(types).astype(str)
    uniq, index = np.unique(types, return_inverse=True)
    sizes = np.bincount(index.ravel(), minlength=uniq.size)
    label = np.zeros(uniq.size, dtype=np.int64)
    n_pos = 0
    for t in sorted(range(uniq.size), key=lambda t: unit_hash(str(uniq[t]), seed)):
        if n_pos == 0 or n_pos + sizes[t] <= types.size // 2:
            label[t] = 1
            n_pos += sizes[t]
    return label[index.ravel()]


def control_na_reason(types: np.ndarray | None, groups: np.ndarray, n_folds: int, seed: int) -> str | None:
    """Why no control task is meaningful here, or None: no types, fewer than 2 types that recur across pairs, or too
    few pair groups per control class for the folds."""
    if types is None:
        return "the passages carry no lexical type (domain): nothing recurs across pairs for a control to memorise"
    types, groups = np.asarray(types).astype(str), np.asarray(groups).astype(str)
    recurring = [t for t in np.unique(types) if np.unique(groups[types == t]).size >= 2]
    if len(recurring) < 2:
        return f"{len(recurring)} lexical type(s) recur across matched pairs; a control task needs >= 2"
    control = control_labels(types, seed)
    for c in (0, 1):
        n_groups = np.unique(groups[control == c]).size
        if n_groups < n_folds:
            return f"control class {c} holds {n_groups} pair groups; {n_folds}-fold CV needs >= {n_folds}"
    return None


def _control_cv(X: np.ndarray, y: np.ndarray, splits: Splits, probe: ProbeFactory,
                seed: int) -> tuple[float, np.ndarray]:
    """(mean fold AUROC, as fold_auroc gives it; out-of-fold scores standardised within each fold, since fold
    models' scores share no scale) from one fit per fold."""
    out, folds = np.empty(y.size), []
    for k, (fit_idx, val_idx) in enumerate(splits):
        if np.unique(y[val_idx]).size < 2 or np.unique(y[fit_idx]).size < 2:
            raise ProbeError(f"control CV fold {k} holds one class only")
        s = np.asarray(probe(seed).fit(X[fit_idx], y[fit_idx]).decision_function(X[val_idx]), dtype=np.float64)
        folds.append(auroc(s, y[val_idx]))
        out[val_idx] = (s - s.mean()) / (s.std() or 1.0)
    return float(np.mean(folds)), out


def selectivity(X: np.ndarray, y: np.ndarray, groups: np.ndarray, types: np.ndarray | None = None, *,
                seed: int = 0, n_folds: int = 5, probe: ProbeFactory = make_logistic_probe,
                true_score: float | None = None, ci_level: float = 0.95) -> Selectivity:
    """S = CV AUROC(concept) - CV AUROC(control), both on pair-grouped folds with the same probe; n/a with the reason
    when `types` (one lexical type per passage) cannot carry a control.

    The control's CI is the pair-clustered interval of its pooled, per-fold standardised out-of-fold scores.
    `true_score` reuses an already computed CV AUROC on the true labels at this seed (D1's cv_auroc).
    """
    X, y, groups = np.asarray(X, dtype=np.float64), np.asarray(y), np.asarray(groups)
    if types is not None and np.asarray(types).shape != y.shape:
        raise ProbeError(f"selectivity: types {np.asarray(types).shape} and labels {y.shape} differ")
    if true_score is None:
        true_score = fold_auroc(X, y, cv_splits(y, groups, n_folds, seed), probe, seed)
    reason = control_na_reason(types, groups, n_folds, seed)
    if reason is not None:
        return Selectivity(true_score=float(true_score), control_score=None, selectivity=None, na_reason=reason)
    control = control_labels(np.asarray(types), seed)
    splits = cv_splits(control, groups, n_folds, seed)
    control_score, oof = _control_cv(X, control, splits, probe, seed)
    ci = auroc_ci(oof, control, groups, ci_level)
    return Selectivity(true_score=float(true_score), control_score=control_score,
                       selectivity=float(true_score) - control_score, control_ci_low=ci.low, control_ci_high=ci.high)
