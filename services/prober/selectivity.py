"""Selectivity (Hewitt & Liang 2019): the probe's score on the concept minus its score on a control task.

The control task gives every matched pair ONE random label shared by both members (the pair plays the role
of H&L's word type, its two passages that of tokens): the label is then a function of content alone and
carries no concept, pairs stay intact so the pair-grouped folds still apply, and each passage's label is
fixed by its id and the seed. Because grouped folds never show a pair's label to the model that scores it,
the control score is what the same probe and CV reach on concept-free labels (about 0.5): S says how far
the concept lifts the probe above that.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from poolbench.prober.auroc import ProbeError
from poolbench.prober.fast_folds import stratified_group_splits as cv_splits
from poolbench.prober.newton_logistic import newton_logistic
from poolbench.prober.seed_spread import ProbeFactory, fold_auroc


@dataclass(frozen=True)
class Selectivity:
    true_score: float
    control_score: float
    selectivity: float


def unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (key, seed) across processes and Python versions (not hash())."""
    digest = hashlib.blake2b(f"{seed}\x1f{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def control_labels(ids: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int) -> np.ndarray:
    """0/1 control labels: one per pair group, keyed by the group's smallest passage id, balance kept.

    Groups are taken in order of unit_hash(min id, seed) and labelled 1 while the count of control
    positives stays <= the true count, so all-pair data get exactly half the pairs (= half the passages).
    """
    ids, y, groups = np.asarray(ids).astype(str), np.asarray(y), np.asarray(groups)
    if not ids.shape == y.shape == groups.shape:
        raise ProbeError(f"control labels: ids {ids.shape}, y {y.shape}, groups {groups.shape} differ")
    if np.unique(ids).size != ids.size:
        raise ProbeError("control labels: passage ids are not unique")
    uniq, index = np.unique(groups, return_inverse=True)
    keys = [min(ids[index == g]) for g in range(uniq.size)]
    sizes = np.bincount(index, minlength=uniq.size)
    target = int(np.sum(y == 1))
    group_label = np.zeros(uniq.size, dtype=np.int64)
    n_pos = 0
    for g in sorted(range(uniq.size), key=lambda g: unit_hash(keys[g], seed)):
        if n_pos + sizes[g] <= target:
            group_label[g] = 1
            n_pos += sizes[g]
    labels = group_label[index]
    if labels.min() == labels.max():
        raise ProbeError(f"control labels: {uniq.size} pair groups cannot carry both classes")
    return labels


def selectivity(X: np.ndarray, y: np.ndarray, groups: np.ndarray, ids: np.ndarray, *, seed: int = 0,
                n_folds: int = 5, probe: ProbeFactory = newton_logistic, true_score: float | None = None,
                init: tuple[np.ndarray, float] | None = None) -> Selectivity:
    """S = CV AUROC(true labels) - CV AUROC(control labels), same probe, same pair-grouped CV procedure.

    `true_score` reuses an already computed CV AUROC on the true labels at this seed.
    """
    if true_score is None:
        true_score = fold_auroc(X, y, cv_splits(y, groups, n_folds, seed), probe, seed, init)
    control = control_labels(ids, y, groups, seed)
    control_score = fold_auroc(X, control, cv_splits(control, groups, n_folds, seed), probe, seed)
    return Selectivity(true_score=float(true_score), control_score=control_score,
                       selectivity=float(true_score) - control_score)
