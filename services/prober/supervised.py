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
import torch
from sklearn.base import BaseEstimator, clone
from sklearn.model_selection import StratifiedGroupKFold

from poolbench.pooler.iti import HEAD_FRACTION, HEADS_META, ITIHeadView
from poolbench.pooler.pooled_table import PooledMatrix
from poolbench.prober.auroc import ProbeError, auroc, auroc_ci
from poolbench.prober.batched_logistic import fit_many
from poolbench.prober.d1 import _BLAS, D1Result, ProbeResult, cv_splits
from poolbench.prober.primal_logistic import fit_primal
from poolbench.prober.probes import PROBE_NAMES, make_probe

INNER_FOLDS = 3


class SupervisedCell(Protocol):
    """Builds a (layer, strategy) cell's features for every row from the labels of `fit_rows` only."""

    def design(self, fit_rows: np.ndarray) -> np.ndarray: ...


def head_aurocs(features: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int = 0,
                device: torch.device | None = None) -> np.ndarray:
    """[H] grouped-CV AUROC of one logistic probe per head on features [n, H, Dh] (training AUROC when the
    rows are too few for grouped folds). With a `device` every head's fits are one primal solve there
    (_head_aurocs_on); without, or where that solve declines, one host estimator a fit (make run's bits)."""
    y = np.asarray(y)
    n_min = min(int(y.sum()), int((1 - y).sum()), np.unique(groups).size)
    # the folds depend on labels and groups only: one split serves every head (it was rebuilt per head)
    folds = (list(StratifiedGroupKFold(INNER_FOLDS, shuffle=True, random_state=seed).split(
        np.zeros((y.size, 1)), y, groups)) if n_min >= INNER_FOLDS else [])
    found = _head_aurocs_on(device, features, y, folds) if device is not None else None
    if found is not None:
        return found
    template = make_probe("logistic", seed)
    scores = np.empty(features.shape[1])
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


def _head_aurocs_on(device: torch.device, features: np.ndarray, y: np.ndarray,
                    folds: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray | None:
    """head_aurocs with every (head, fold) fit one slice of a primal batch on `device` (primal_logistic: heads as
    cells sharing each fold's rows); None where the solve declines (a fit short of tol: the host path warns for it).
    A fold whose fit or validation rows hold one class is skipped for every head at once (it depends on the labels
    alone), as the host path skips it per head. The AUROCs equal the host's unless two scores of a fold fall within
    the stopping rule's bound of each other (rank statistics)."""
    heads = features.shape[1]
    X = torch.as_tensor(np.ascontiguousarray(np.asarray(features, dtype=np.float64).transpose(1, 0, 2)),
                        device=device)  # [H, n, Dh]: each head a cell
    usable = [(fit, val) for fit, val in folds if np.unique(y[fit]).size == 2 and np.unique(y[val]).size == 2]
    every = np.arange(y.size)
    usable = usable or [(every, every)]  # too few rows for grouped folds: the training AUROC of an all-rows fit
    fits = fit_primal(X, [fit for fit, _ in usable], [y[fit] for fit, _ in usable])
    if fits is None:
        return None
    scores = fits.scores(X).cpu().numpy()
    return np.array([float(np.mean([auroc(scores[h, k, val], y[val]) for k, (_, val) in enumerate(usable)]))
                     for h in range(heads)])


def n_heads_kept(n_heads: int, fraction: float = HEAD_FRACTION) -> int:
    """A fraction of the model's heads, at least one (4 heads at 25% keep 1: S3 never collapses into S1)."""
    return max(1, min(n_heads, math.floor(fraction * n_heads + 0.5)))


@dataclass
class HeadSelectionCell:
    """S3's cell: per-head pooled vectors [H, N, d] (float32 as stored, or float64), per-head features [N, H, Dh],
    labels, groups."""

    pooled: np.ndarray
    features: np.ndarray
    y: np.ndarray
    groups: np.ndarray
    n_keep: int
    seed: int = 0
    chosen: list[list[int]] = field(default_factory=list)  # heads picked by each design() call, in order
    device: torch.device | None = None  # the probes' GPU: the ranking's and the logistic probe's fits run there

    def select(self, fit_rows: np.ndarray) -> list[int]:
        scores = head_aurocs(self.features[fit_rows], self.y[fit_rows], self.groups[fit_rows], self.seed,
                             device=self.device)
        order = sorted(range(len(scores)), key=lambda h: (-scores[h], h))
        return sorted(order[: self.n_keep])

    def design(self, fit_rows: np.ndarray) -> np.ndarray:
        heads = self.select(np.asarray(fit_rows))
        self.chosen.append(heads)
        return mean_of_heads(self.pooled, heads)


def mean_of_heads(pooled: np.ndarray, heads: list[int]) -> np.ndarray:
    """pooled[heads].mean(axis=0) of the float64 heads to the bit, without its copy of the chosen heads: numpy
    reduces a leading axis one slice after another into the output, which is this loop (tests/test_s3_supervised.py
    holds them equal). At the driver's size (8 of 32 heads, 2,000 passages, d 4,096) the copy was 524 MB a design,
    six designs a layer. Float32 heads (as the table stores them) widen as they are added, exactly: the cell need not
    hold a float64 copy of all its heads (2.1 GB a layer there)."""
    total = pooled[heads[0]].astype(np.float64)
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
            device = getattr(cell, "device", None) if name == "logistic" else None
            oof = np.empty(train.size)
            oof_folds = np.full(train.size, -1, dtype=np.int64)
            fold_aurocs = np.empty(len(folds))
            for k, (fit, val, X) in enumerate(folds):
                oof[val] = _fit_and_score(template, device, X, train[fit], y[train[fit]], train[val])
                oof_folds[val] = k
                fold_aurocs[k] = auroc(oof[val], y[train[val]])
            test_scores = _fit_and_score(template, device, X_all, train, y[train], test)
            ci = auroc_ci(test_scores, y[test], groups[test], ci_level)
            results[name] = ProbeResult(
                probe=name, cv_auroc=float(fold_aurocs.mean()), cv_fold_aurocs=fold_aurocs,
                test_auroc=auroc(test_scores, y[test]), ci_low=ci.low, ci_high=ci.high, n_train=int(train.size),
                n_test=int(test.size), n_folds=len(folds), n_bootstrap=n_bootstrap, ci_level=ci_level,
                oof_scores=oof, test_scores=test_scores,
                test_pred=(test_scores > 0).astype(np.int64),  # predict's classes [0, 1] at the same scores
                ci_method=ci.method, ci_degenerate=ci.degenerate, oof_folds=oof_folds,
            )
    return D1Result(probes=results, seed=seed)


def _fit_and_score(template: BaseEstimator, device: torch.device | None, X: np.ndarray, fit_rows: np.ndarray,
                   labels: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The probe fitted on X's `fit_rows`, its decision scores of `rows`: the host estimator, or on a GPU
    (`device`, the logistic probe) batched_logistic's solver there, as D1's unsupervised cells are fitted, equal
    within its stopping rule. On the host S3's six logistic fits at d 4,096 were most of the 4.4 s its cell spent
    beside its head rankings at the driver's size (this CPU, one thread)."""
    if device is None:
        model = clone(template).fit(X[fit_rows], labels)
        return np.asarray(model.decision_function(X[rows]), dtype=np.float64)
    on = torch.as_tensor(X, device=device)
    fits = fit_many(on, [fit_rows], [labels])
    return fits.scores(on[torch.as_tensor(rows, device=device)])[0].cpu().numpy()


def head_selection_cell(cell: PooledMatrix, metadata: Mapping[str, str], heads: ITIHeadView | None, layer: int,
                        strategy: str, seed: int = 0, device: torch.device | None = None
                        ) -> HeadSelectionCell | None:
    """The S3 cell of (layer, strategy), its rows in the order of `cell`, or None for an unsupervised strategy
    (one whose PooledTable metadata names no heads); `device`: the GPU its fits run on (None: the host's
    estimators, one fit at a time)."""
    if f"{strategy}{HEADS_META}" not in metadata:
        return None
    if heads is None:
        raise ProbeError(f"strategy {strategy!r} layer {layer}: supervised, but its ITIHeadTable was not given")
    pooled, outputs = heads.cell(layer, strategy, cell.passage_ids)
    return HeadSelectionCell(
        pooled=pooled, features=outputs.astype(np.float64), y=cell.y, groups=cell.groups,
        n_keep=n_heads_kept(pooled.shape[0], heads.head_fraction(strategy)), seed=seed, device=device,
    )
