"""D1 for supervised strategies: the design matrix is rebuilt inside every fold from that fold's labels only.

A `SupervisedCell` turns "these rows may be looked at, labels included" into the X of every row. D1 calls it
once per CV fold with the fold's training rows and once with the whole train split for the held-out test, so
no label of a passage that is being scored ever shapes its features. `HeadSelectionCell` is S3_iti_probe's:
heads are ranked by the grouped-CV AUROC of a logistic probe on their last-token outputs, the top
`n_keep` are kept, and X is the mean of their per-head pooled vectors (the pooled vector of the mean of
their per-head-normalised attention inflow). Both per-head arrays come from the concept's ITIHeadTable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from sklearn.base import clone
from sklearn.model_selection import StratifiedGroupKFold

from poolbench.pooler.iti import HEAD_FRACTION, HEADS_META, ITIHeadView
from poolbench.pooler.pooled_table import PooledMatrix
from poolbench.prober.auroc import ProbeError, auroc, auroc_ci
from poolbench.prober.d1 import _BLAS, D1Result, ProbeResult, cv_splits
from poolbench.prober.probes import PROBE_NAMES, make_probe

INNER_FOLDS = 3


class SupervisedCell(Protocol):
    """Builds a (layer, strategy) cell's features for every row from the labels of `fit_rows` only."""

    def design(self, fit_rows: np.ndarray) -> np.ndarray: ...


def head_aurocs(features: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int = 0) -> np.ndarray:
    """[H] grouped-CV AUROC of one logistic probe per head on features [n, H, Dh] (training AUROC when the
    rows are too few for grouped folds)."""
    y = np.asarray(y)
    n_min = min(int(y.sum()), int((1 - y).sum()), np.unique(groups).size)
    template = make_probe("logistic", seed)
    scores = np.empty(features.shape[1])
    # the folds depend on labels and groups only: one split serves every head (it was rebuilt per head)
    folds = (list(StratifiedGroupKFold(INNER_FOLDS, shuffle=True, random_state=seed).split(
        np.zeros((y.size, 1)), y, groups)) if n_min >= INNER_FOLDS else [])
    for h in range(features.shape[1]):
        X = features[:, h]
        if n_min >= INNER_FOLDS:
            per_fold = []
            for fit, val in folds:
                if np.unique(y[fit]).size < 2 or np.unique(y[val]).size < 2:
                    continue
                model = clone(template).fit(X[fit], y[fit])
                per_fold.append(auroc(model.decision_function(X[val]), y[val]))
            if per_fold:
                scores[h] = float(np.mean(per_fold))
                continue
        scores[h] = auroc(clone(template).fit(X, y).decision_function(X), y)
    return scores


def n_heads_kept(n_heads: int, fraction: float = HEAD_FRACTION) -> int:
    """A fraction of the model's heads, at least one (4 heads at 25% keep 1: S3 never collapses into S1)."""
    return max(1, min(n_heads, math.floor(fraction * n_heads + 0.5)))


@dataclass
class HeadSelectionCell:
    """S3's cell: per-head pooled vectors [H, N, d], per-head features [N, H, Dh], labels, groups."""

    pooled: np.ndarray
    features: np.ndarray
    y: np.ndarray
    groups: np.ndarray
    n_keep: int
    seed: int = 0
    chosen: list[list[int]] = field(default_factory=list)  # heads picked by each design() call, in order

    def select(self, fit_rows: np.ndarray) -> list[int]:
        scores = head_aurocs(self.features[fit_rows], self.y[fit_rows], self.groups[fit_rows], self.seed)
        order = sorted(range(len(scores)), key=lambda h: (-scores[h], h))
        return sorted(order[: self.n_keep])

    def design(self, fit_rows: np.ndarray) -> np.ndarray:
        heads = self.select(np.asarray(fit_rows))
        self.chosen.append(heads)
        return mean_of_heads(self.pooled, heads)


def mean_of_heads(pooled: np.ndarray, heads: list[int]) -> np.ndarray:
    """pooled[heads].mean(axis=0) to the bit, without its copy of the chosen heads: numpy reduces a leading axis
    one slice after another into the output, which is this loop (tests/test_s3_supervised.py holds them equal). At the
    driver's size (8 of 32 heads, 2,000 passages, d 4,096) the copy was 524 MB a design, six designs a layer."""
    total = pooled[heads[0]].copy()
    for head in heads[1:]:
        total += pooled[head]
    total /= len(heads)
    return total


def evaluate_d1_supervised(cell: SupervisedCell, y: np.ndarray, groups: np.ndarray, train: np.ndarray,
                           test: np.ndarray, *, n_folds: int = 5, seed: int = 0, n_bootstrap: int = 1000,
                           probes: tuple[str, ...] = PROBE_NAMES, ci_level: float = 0.95) -> D1Result:
    """D1 as evaluate_d1 computes it (same folds, probes and CI), with X rebuilt per fold by the cell."""
    y = np.asarray(y).astype(np.int64)
    groups = np.asarray(groups)
    train, test = np.asarray(train), np.asarray(test)
    for name, rows in (("train", train), ("test", test)):
        if np.unique(y[rows]).size < 2:
            raise ProbeError(f"{name} split: labels hold one class only")
    splits = cv_splits(y[train], groups[train], n_folds, seed)
    with _BLAS.limit(limits=1, user_api="blas"):
        folds = [(fit, val, np.asarray(cell.design(train[fit]), dtype=np.float64)) for fit, val in splits]
        X_all = np.asarray(cell.design(train), dtype=np.float64)
        results = {}
        for name in probes:
            template = make_probe(name, seed)
            oof = np.empty(train.size)
            oof_folds = np.full(train.size, -1, dtype=np.int64)
            fold_aurocs = np.empty(len(folds))
            for k, (fit, val, X) in enumerate(folds):
                model = clone(template).fit(X[train[fit]], y[train[fit]])
                oof[val] = model.decision_function(X[train[val]])
                oof_folds[val] = k
                fold_aurocs[k] = auroc(oof[val], y[train[val]])
            model = clone(template).fit(X_all[train], y[train])
            test_scores = np.asarray(model.decision_function(X_all[test]), dtype=np.float64)
            ci = auroc_ci(test_scores, y[test], groups[test], ci_level)
            results[name] = ProbeResult(
                probe=name, cv_auroc=float(fold_aurocs.mean()), cv_fold_aurocs=fold_aurocs,
                test_auroc=auroc(test_scores, y[test]), ci_low=ci.low, ci_high=ci.high, n_train=int(train.size),
                n_test=int(test.size), n_folds=len(folds), n_bootstrap=n_bootstrap, ci_level=ci_level,
                oof_scores=oof, test_scores=test_scores,
                test_pred=np.asarray(model.predict(X_all[test]), dtype=np.int64),
                ci_method=ci.method, ci_degenerate=ci.degenerate, oof_folds=oof_folds,
            )
    return D1Result(probes=results, seed=seed)


def head_selection_cell(cell: PooledMatrix, metadata: Mapping[str, str], heads: ITIHeadView | None, layer: int,
                        strategy: str, seed: int = 0) -> HeadSelectionCell | None:
    """The S3 cell of (layer, strategy), its rows in the order of `cell`, or None for an unsupervised strategy
    (one whose PooledTable metadata names no heads)."""
    if f"{strategy}{HEADS_META}" not in metadata:
        return None
    if heads is None:
        raise ProbeError(f"strategy {strategy!r} layer {layer}: supervised, but its ITIHeadTable was not given")
    pooled, outputs = heads.cell(layer, strategy, cell.passage_ids)
    return HeadSelectionCell(
        pooled=pooled.astype(np.float64), features=outputs.astype(np.float64), y=cell.y, groups=cell.groups,
        n_keep=n_heads_kept(pooled.shape[0], heads.head_fraction(strategy)), seed=seed,
    )
