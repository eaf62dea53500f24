"""Metric D1: how linearly decodable a concept is from one pooled representation.

Per probe: pair-grouped cross-validated AUROC on the train split, train->test AUROC on the held-out
split, and a pair-clustered DeLong CI of the test AUROC (auroc_ci). Arrays in, a dataclass out; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import StratifiedKFold
from threadpoolctl import ThreadpoolController

from poolbench.prober.auroc import AUROC_CI_METHOD, ProbeError, auroc, auroc_ci
from poolbench.prober.fast_folds import check_folds, stratified_group_splits
from poolbench.prober.probes import PROBE_NAMES, make_probe

__all__ = [
    "CVResult",
    "D1Result",
    "ProbeError",
    "ProbeResult",
    "cv_auroc",
    "cv_splits",
    "evaluate_d1",
]

# Matrices of a few hundred rows are faster on one BLAS thread; cells run in parallel one level up.
_BLAS = ThreadpoolController()


@dataclass(frozen=True)
class CVResult:
    """Cross-validated AUROC: the mean over folds, each fold's AUROC, every passage's out-of-fold score."""

    auroc: float
    fold_aurocs: np.ndarray  # [n_folds]
    oof_scores: np.ndarray  # [n_train], each scored by the model that did not see its fold
    oof_folds: np.ndarray | None = None  # [n_train] the fold that scored each passage


@dataclass(frozen=True)
class ProbeResult:
    """One probe's D1 numbers plus the per-passage scores that paired tests (McNemar, DeLong) need later."""

    probe: str
    cv_auroc: float
    cv_fold_aurocs: np.ndarray
    test_auroc: float
    ci_low: float
    ci_high: float
    n_train: int
    n_test: int
    n_folds: int
    n_bootstrap: int
    ci_level: float
    oof_scores: np.ndarray = field(repr=False)  # [n_train] out-of-fold decision scores
    test_scores: np.ndarray = field(repr=False)  # [n_test] decision scores of the all-train fit
    test_pred: np.ndarray = field(repr=False)  # [n_test] 0/1 predictions of the all-train fit
    ci_method: str = AUROC_CI_METHOD
    ci_degenerate: bool = False  # perfect separation: the CI rests on the worst-case variance bound
    oof_folds: np.ndarray | None = field(default=None, repr=False)  # [n_train] the fold that scored each passage

    def to_record(self) -> dict:
        """The scalar summary as a flat JSON-able dict (per-passage arrays travel separately)."""
        return {
            "probe": self.probe,
            "cv_auroc": self.cv_auroc,
            "cv_fold_aurocs": [float(v) for v in self.cv_fold_aurocs],
            "test_auroc": self.test_auroc,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "ci_level": self.ci_level,
            "ci_method": self.ci_method,
            "ci_degenerate": self.ci_degenerate,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "n_folds": self.n_folds,
            "n_bootstrap": self.n_bootstrap,
        }


@dataclass(frozen=True)
class D1Result:
    """D1 for one (layer, strategy, concept) cell: a ProbeResult per probe name, in the order asked for."""

    probes: dict[str, ProbeResult]
    seed: int

    def __getitem__(self, probe: str) -> ProbeResult:
        return self.probes[probe]

    def to_records(self) -> list[dict]:
        return [result.to_record() for result in self.probes.values()]


def check_split(
    split: str, X: np.ndarray, y: np.ndarray, groups: np.ndarray, *, float64: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, groups) checked, one line naming what is wrong otherwise. X comes back as float64 (a copy of a float32
    table's rows), or with `float64=False` in its own floating dtype, no copy: for a caller that moves the rows to a
    device and widens them there (batched_cell), where 19 host copies at twice the bytes were most of a GPU layer
    task's seconds. The checks are the same either way: a float32 value is finite exactly when its float64 is."""
    X = np.asarray(X)
    if float64 or not np.issubdtype(X.dtype, np.floating):
        X = X.astype(np.float64, copy=False)
    y = np.asarray(y)
    groups = np.asarray(groups)
    if X.ndim != 2:
        raise ProbeError(f"{split} split: X must be 2-D [passages, features], got shape {X.shape}")
    if y.shape != (X.shape[0],) or groups.shape != (X.shape[0],):
        raise ProbeError(
            f"{split} split: X has {X.shape[0]} rows but y has shape {y.shape} and groups {groups.shape}"
        )
    if not np.all(np.isin(y, (0, 1))):
        raise ProbeError(f"{split} split: labels must be 0/1, got values {np.unique(y)[:5].tolist()}")
    n_bad = int(np.sum(~np.isfinite(X).all(axis=1)))
    if n_bad:
        raise ProbeError(f"{split} split: {n_bad} of {X.shape[0]} passages have NaN/inf features")
    n_pos = int(y.sum())
    if n_pos in (0, y.size):
        raise ProbeError(f"{split} split: labels hold one class only ({n_pos} pos, {y.size - n_pos} neg)")
    return X, y.astype(np.int64), groups


def cv_splits(
    y: np.ndarray, groups: np.ndarray, n_folds: int = 5, seed: int = 0, grouped: bool = True
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train_idx, val_idx) per fold; grouped keeps every matched pair inside one fold.

    `grouped=False` (plain shuffled StratifiedKFold) exists only to show the pair leak it causes.
    """
    y = np.asarray(y)
    groups = np.asarray(groups)
    check_folds(y, groups, n_folds)
    placeholder = np.zeros((y.size, 1))
    if grouped:
        # The same folds as sklearn's StratifiedGroupKFold(shuffle=True), vectorised: ~4 ms instead of ~70.
        return stratified_group_splits(y, groups, n_folds, seed)
    splitter = StratifiedKFold(n_splits=n_folds, shuffle=True, random_state=seed)
    return list(splitter.split(placeholder, y))


def _scores(model, X: np.ndarray) -> np.ndarray:
    return np.asarray(model.decision_function(X), dtype=np.float64)


def _cross_validate(
    X: np.ndarray, y: np.ndarray, splits: list[tuple[np.ndarray, np.ndarray]], probe: str, seed: int
) -> CVResult:
    template = make_probe(probe, seed)
    fold_aurocs = np.empty(len(splits))
    oof = np.empty(y.size)
    folds = np.full(y.size, -1, dtype=np.int64)
    for k, (fit_idx, val_idx) in enumerate(splits):
        if np.unique(y[val_idx]).size < 2 or np.unique(y[fit_idx]).size < 2:
            raise ProbeError(f"CV fold {k} holds one class only; the pair groups are too lopsided")
        model = clone(template).fit(X[fit_idx], y[fit_idx])
        oof[val_idx] = _scores(model, X[val_idx])
        folds[val_idx] = k
        fold_aurocs[k] = auroc(oof[val_idx], y[val_idx])
    return CVResult(auroc=float(fold_aurocs.mean()), fold_aurocs=fold_aurocs, oof_scores=oof, oof_folds=folds)


def cv_auroc(
    X: np.ndarray,
    y: np.ndarray,
    groups: np.ndarray,
    probe: str = "logistic",
    *,
    n_folds: int = 5,
    seed: int = 0,
    grouped: bool = True,
) -> CVResult:
    """K-fold AUROC on one split: the mean of per-fold AUROCs, since fold models' scores share no scale."""
    X, y, groups = check_split("train", X, y, groups)
    with _BLAS.limit(limits=1, user_api="blas"):
        return _cross_validate(X, y, cv_splits(y, groups, n_folds, seed, grouped), probe, seed)


def evaluate_d1(
    X_train: np.ndarray,
    y_train: np.ndarray,
    groups_train: np.ndarray,
    X_test: np.ndarray,
    y_test: np.ndarray,
    groups_test: np.ndarray,
    *,
    n_folds: int = 5,
    seed: int = 0,
    n_bootstrap: int = 1000,
    probes: tuple[str, ...] = PROBE_NAMES,
    ci_level: float = 0.95,
) -> D1Result:
    """D1 of one cell: per probe, grouped CV AUROC on train, train->test AUROC, and its group-bootstrap CI.

    `groups_*` give each passage its matched_pair_id, or its own id when unpaired.
    """
    X_train, y_train, groups_train = check_split("train", X_train, y_train, groups_train)
    X_test, y_test, groups_test = check_split("test", X_test, y_test, groups_test)
    if X_train.shape[1] != X_test.shape[1]:
        raise ProbeError(f"train has {X_train.shape[1]} features but test has {X_test.shape[1]}")
    splits = cv_splits(y_train, groups_train, n_folds, seed)
    with _BLAS.limit(limits=1, user_api="blas"):
        return D1Result(probes={
            name: _evaluate_probe(name, X_train, y_train, X_test, y_test, groups_test, splits,
                                  seed=seed, n_bootstrap=n_bootstrap, ci_level=ci_level)
            for name in probes
        }, seed=seed)


def _evaluate_probe(
    name: str,
    X_train: np.ndarray,
    y_train: np.ndarray,
    X_test: np.ndarray,
    y_test: np.ndarray,
    groups_test: np.ndarray,
    splits: list[tuple[np.ndarray, np.ndarray]],
    *,
    seed: int,
    n_bootstrap: int,
    ci_level: float,
) -> ProbeResult:
    cv = _cross_validate(X_train, y_train, splits, name, seed)
    model = make_probe(name, seed).fit(X_train, y_train)
    test_scores = _scores(model, X_test)
    ci = auroc_ci(test_scores, y_test, groups_test, ci_level)
    return ProbeResult(
        probe=name,
        cv_auroc=cv.auroc,
        cv_fold_aurocs=cv.fold_aurocs,
        test_auroc=auroc(test_scores, y_test),
        ci_low=ci.low,
        ci_high=ci.high,
        n_train=int(y_train.size),
        n_test=int(y_test.size),
        n_folds=len(splits),
        n_bootstrap=n_bootstrap,
        ci_level=ci_level,
        oof_scores=cv.oof_scores,
        test_scores=test_scores,
        test_pred=np.asarray(model.predict(X_test), dtype=np.int64),
        ci_method=ci.method,
        ci_degenerate=ci.degenerate,
        oof_folds=cv.oof_folds,
    )
