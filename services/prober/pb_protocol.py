"""D1 under the reference leaderboard's protocol ("pb"): what its published numbers are, so ours can stand beside them.

The reference's evaluation (`compute_train_test_auroc_for_strategy`, protocol "5fold_oof", in its
poolbench/evaluation/probe.py), in steps:
1. the train split only: its positive rows, then its negative rows, each in corpus order, as float32;
2. every row L2-normalised: x / (|x| + 1e-9);
3. StratifiedKFold(5, shuffle=True, random_state=42) over that order (the order decides the folds);
4. per fold, the DiffMean direction of the fold's training rows, mean(pos) - mean(neg), made unit: d / (|d| + 1e-9);
   the fold's held-out rows are scored x . d (a fold with one class only scores 0);
5. ONE AUROC over the concatenated out-of-fold scores;
6. a 95% percentile interval from 1,000 resamples of the (score, label) pairs, numpy's default_rng(42) drawing
   every resample at once, resamples holding one class skipped.
There is no held-out test: the number is cross-validated only. Shuffled StratifiedKFold ignores matched pairs, so a
pair's twins can sit on both sides of a fold: PoolBench's own protocol keeps them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold

from poolbench.defaults import PB_PROTOCOL
from poolbench.prober.auroc import ProbeError

PB_VERSION = 2  # 2: the train split folded in corpus order (1 folded the pooled table's row order, not the reference's)
PB_SEED = 42
PB_FOLDS = 5
PB_BOOTSTRAP = 1000
PB_EPS = 1e-9
PB_CI_METHOD = "pb_oof_pair_bootstrap_percentile"


@dataclass(frozen=True)
class PBResult:
    """The PB protocol's D1 of one cell: the out-of-fold AUROC, its bootstrap interval and spread."""

    auroc: float
    ci_low: float
    ci_high: float
    std: float
    n_pos: int
    n_neg: int
    n_folds: int
    n_bootstrap: int
    oof_scores: np.ndarray = field(repr=False)  # [n], in the order of pb_order(y), float32 as the reference
    order: np.ndarray = field(repr=False)  # [n] row indices of the caller's X: positives, then negatives


def pb_order(y: np.ndarray) -> np.ndarray:
    """Row indices as the reference stacks them: every positive, then every negative, each in the given order."""
    y = np.asarray(y)
    return np.concatenate([np.flatnonzero(y == 1), np.flatnonzero(y == 0)])


def corpus_rows(passage_ids: Sequence[str], corpus_order: Sequence[str]) -> np.ndarray:
    """Indices that put `passage_ids` in corpus order (`corpus_order`: every passage id of the concept as its corpus
    files list them): the reference stacks rows in that order, and a stored table keeps its pooling batches' order."""
    rank = {pid: i for i, pid in enumerate(corpus_order)}
    missing = [str(pid) for pid in passage_ids if str(pid) not in rank]
    if missing:
        raise ProbeError(f"pb protocol: passage {missing[0]} is not in the corpus order given "
                         f"({len(missing)} of {len(passage_ids)} missing)")
    return np.argsort(np.array([rank[str(pid)] for pid in passage_ids], dtype=np.int64), kind="stable")


def pb_key_fields() -> dict[str, object]:
    """What a PB-protocol D1 artifact's key adds to PoolBench's: the protocol and its version."""
    return {"protocol": PB_PROTOCOL, "pb_version": PB_VERSION}


def bootstrap_aurocs(scores: np.ndarray, labels: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """AUROC of each resample (rows of `draws`, indices into scores), resamples with one class dropped: the
    Mann-Whitney count with ties at 1/2 over resample multiplicities, what roc_auc_score gives on each resample."""
    scores, labels = np.asarray(scores), np.asarray(labels).astype(bool)
    values, level = np.unique(scores, return_inverse=True)
    counts = np.zeros((draws.shape[0], len(scores)), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(draws.shape[0]), draws.shape[1]), draws.ravel()), 1)
    pos = np.zeros((draws.shape[0], len(values)), dtype=np.float64)
    neg = np.zeros_like(pos)
    np.add.at(pos.T, level[labels], counts[:, labels].T)
    np.add.at(neg.T, level[~labels], counts[:, ~labels].T)
    below = np.cumsum(neg, axis=1) - neg  # negatives strictly below each score level
    n_pos, n_neg = pos.sum(axis=1), neg.sum(axis=1)
    keep = (n_pos > 0) & (n_neg > 0)
    wins = (pos * (below + 0.5 * neg)).sum(axis=1)
    return wins[keep] / (n_pos[keep] * n_neg[keep])


def pb_d1(X: np.ndarray, y: np.ndarray, *, n_folds: int = PB_FOLDS, seed: int = PB_SEED,
          n_bootstrap: int = PB_BOOTSTRAP) -> PBResult:
    """D1 of one cell's train split under the PB protocol (module docstring); X rows and y in corpus order."""
    y = np.asarray(y)
    if X.ndim != 2 or len(X) != len(y) or not np.isin(y, (0, 1)).all():
        raise ProbeError(f"pb protocol: X must be [passages, d] with 0/1 labels, got X {X.shape}, y {y.shape}")
    order = pb_order(y)
    Xo = np.asarray(X, dtype=np.float32)[order]
    yo = y[order].astype(np.int32)
    n_pos = int(yo.sum())
    if n_pos < n_folds or len(yo) - n_pos < n_folds:
        raise ProbeError(f"pb protocol: {n_pos} positive and {len(yo) - n_pos} negative train passages; "
                         f"StratifiedKFold({n_folds}) needs {n_folds} of each")
    Xo /= np.linalg.norm(Xo, axis=1, keepdims=True) + np.float32(PB_EPS)
    oof = np.empty(len(yo), dtype=np.float32)
    for fit, held in StratifiedKFold(n_splits=n_folds, shuffle=True, random_state=seed).split(Xo, yo):
        pos, neg = Xo[fit][yo[fit] == 1], Xo[fit][yo[fit] == 0]
        if len(pos) == 0 or len(neg) == 0:
            oof[held] = 0.0
            continue
        d = pos.mean(axis=0) - neg.mean(axis=0)
        d = d / (np.linalg.norm(d) + np.float32(PB_EPS))
        oof[held] = Xo[held] @ d
    auroc = float(roc_auc_score(yo, oof))
    draws = np.random.default_rng(seed).integers(0, len(yo), size=(n_bootstrap, len(yo)))
    boot = bootstrap_aurocs(oof, yo, draws) if n_bootstrap else np.zeros(0)
    low, high = (float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))) if len(boot) else (auroc, auroc)
    return PBResult(auroc=auroc, ci_low=low, ci_high=high, std=float(np.std(boot)) if len(boot) else 0.0,
                    n_pos=n_pos, n_neg=len(yo) - n_pos, n_folds=n_folds, n_bootstrap=n_bootstrap,
                    oof_scores=oof, order=order)
