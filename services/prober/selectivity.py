"""Selectivity (Hewitt & Liang 2019): the probe's score on the concept minus its score on a control task.

H&L's control task gives every word TYPE a random label; a probe can reach it only by memorising the
type -> label map, which works because tokens of one type recur between training and evaluation. Its score
is therefore the probe's capacity to memorise content, and selectivity is how far the concept lifts the probe
above that capacity. A PoolBench passage's recurring type is its matched pair: the twin is a controlled
rewrite that shares nearly all of its content. So the control gives both members of a pair one random label
(fixed by the pair's smallest id and the seed, balance kept) and, unlike the concept task, deals the two
members into DIFFERENT folds, so every evaluated passage's twin was in the probe's training set. The concept
task must keep pairs together (twins carry opposite concept labels, so a split pair leaks); the control task
must split them (twins carry the same control label, so a split pair is the recurrence H&L rely on). A probe
that can tie a label to a passage's content scores well above 0.5 on the control; one that cannot stays
near 0.5. Unpaired passages are types seen once: a corpus without pairs leaves the control at chance.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from poolbench.prober.auroc import ProbeError
from poolbench.prober.fast_folds import stratified_group_splits as cv_splits
from poolbench.prober.probes import make_logistic_probe
from poolbench.prober.seed_spread import ProbeFactory, Splits, fold_auroc


@dataclass(frozen=True)
class Selectivity:
    true_score: float
    control_score: float
    selectivity: float


def unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (key, seed) across processes and Python versions (not hash())."""
    digest = hashlib.blake2b(f"{seed}\x1f{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _group_keys(ids: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(group index per passage, each group's smallest passage id, group sizes)."""
    uniq, index = np.unique(groups, return_inverse=True)
    keys = [min(ids[index == g]) for g in range(uniq.size)]
    return index, keys, np.bincount(index, minlength=uniq.size)


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
    index, keys, sizes = _group_keys(ids, groups)
    target = int(np.sum(y == 1))
    group_label = np.zeros(sizes.size, dtype=np.int64)
    n_pos = 0
    for g in sorted(range(sizes.size), key=lambda g: unit_hash(keys[g], seed)):
        if n_pos + sizes[g] <= target:
            group_label[g] = 1
            n_pos += sizes[g]
    labels = group_label[index]
    if labels.min() == labels.max():
        raise ProbeError(f"control labels: {sizes.size} pair groups cannot carry both classes")
    return labels


def control_splits(ids: np.ndarray, control: np.ndarray, groups: np.ndarray, n_folds: int,
                   seed: int) -> Splits:
    """(train_idx, val_idx) per fold with each pair's members in different folds, stratified by control label.

    Per control class, groups are taken in order of unit_hash(min id, seed) and their members (by id) are
    dealt round-robin into the folds: twins land in consecutive folds, each fold gets its share of each class.
    """
    ids, control, groups = np.asarray(ids).astype(str), np.asarray(control), np.asarray(groups)
    for c in (0, 1):
        if np.sum(control == c) < n_folds:
            raise ProbeError(f"control task: {int(np.sum(control == c))} passages of class {c}; "
                             f"{n_folds}-fold CV needs >= {n_folds}")
    index, keys, _ = _group_keys(ids, groups)
    fold = np.empty(ids.size, dtype=np.int64)
    for c in (0, 1):
        members = np.flatnonzero(control == c)
        ordered = sorted(members, key=lambda i: (unit_hash(keys[index[i]], seed), keys[index[i]], ids[i]))
        fold[np.asarray(ordered)] = np.arange(len(ordered)) % n_folds
    everything = np.arange(ids.size)
    return [(everything[fold != k], everything[fold == k]) for k in range(n_folds)]


def selectivity(X: np.ndarray, y: np.ndarray, groups: np.ndarray, ids: np.ndarray, *, seed: int = 0,
                n_folds: int = 5, probe: ProbeFactory = make_logistic_probe,
                true_score: float | None = None) -> Selectivity:
    """S = CV AUROC(concept, pair-grouped folds) - CV AUROC(control, pair-splitting folds), same probe.

    `true_score` reuses an already computed CV AUROC on the true labels at this seed (D1's cv_auroc).
    """
    if true_score is None:
        true_score = fold_auroc(X, y, cv_splits(y, groups, n_folds, seed), probe, seed)
    control = control_labels(ids, y, groups, seed)
    control_score = fold_auroc(X, control, control_splits(ids, control, groups, n_folds, seed), probe, seed)
    return Selectivity(true_score=float(true_score), control_score=control_score,
                       selectivity=float(true_score) - control_score)
