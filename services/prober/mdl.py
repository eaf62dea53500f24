"""Prequential (online) minimum description length of a probe (Voita & Titov 2020), with calibrated blocks.

Labels are sent block by block in a fixed order: the first block with the uniform code (1 bit per binary
label), every later block with a code built only from the passages before it, costing -log2 p(label) bits.
A concept the representation makes easy to learn compresses well: compression = uniform / online.

Two choices fit PoolBench's small train splits (~160 to ~1,400 passages), where Voita & Titov's 0.1% first
block of a 10^4-10^5 example dataset becomes 2 passages. A floor: no block boundary lies below `min_block`
passages, so the first probe is fitted on at least that many (standardising 256+ features from 2 passages
sends unseen passages to logits in the hundreds). Calibration: a C = 1 logistic on fewer passages than
features separates them and is overconfident at every block size (the plain code with a 2-passage first
block gave compression <= 1 in 530 of the embedded run's 1,087 cells that CV decodes at AUROC > 0.65). So
each block is coded by D1's probe fitted on the folds of a pair-grouped K-fold split of the earlier passages;
their logits go through Platt scaling (1999, with his prior-smoothed targets) fitted on the same models'
out-of-fold logits, and the K probabilities are averaged. Calibrating the very models that code the block
keeps the logit scale the same (a refit on the whole prefix is more confident than the folds that calibrated
it); a slope of 0 falls back to the prefix's class prior. A prefix too small to cross-validate sends its
block with the uniform code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

from poolbench.prober.auroc import ProbeError
from poolbench.prober.fast_folds import stratified_group_splits
from poolbench.prober.probes import make_logistic_probe
from poolbench.prober.seed_spread import ProbeFactory

MDL_FRACTIONS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)
MDL_MIN_BLOCK = 16  # passages; the first block (uniform code) holds at least this many, capped at half of train
MDL_CALIBRATION_FOLDS = 3  # pair-grouped folds of the earlier passages: the coding models and Platt's data
MDL_MIN_BLOCKS = 5  # fewer blocks (first included) is not prequential: one or two fits code everything


@dataclass(frozen=True)
class OnlineCode:
    """Codelengths in bits; block_ends[i] is the exclusive end of block i in the transmission order."""

    uniform_bits: float
    online_bits: float | None
    compression: float | None
    block_ends: tuple[int, ...]
    block_bits: tuple[float, ...]
    na_reason: str | None = None  # why online_bits/compression are None (too few blocks)


def transmission_order(groups: np.ndarray, seed: int, shuffle: bool = True) -> np.ndarray:
    """Passage indices with pair groups in a seeded random order and each group's members adjacent.

    Keeping a pair together stops a passage being coded by a probe that has already seen its twin.
    """
    _, first, index = np.unique(np.asarray(groups), return_index=True, return_inverse=True)
    group_order = np.argsort(first, kind="stable")
    if shuffle:
        group_order = np.random.default_rng(seed).permutation(group_order)
    rank = np.empty_like(group_order)
    rank[group_order] = np.arange(group_order.size)
    return np.lexsort((np.arange(index.size), rank[index]))


def block_ends(group_sizes: Sequence[int], fractions: Sequence[float] = MDL_FRACTIONS,
               min_block: int = 0) -> list[int]:
    """Block boundaries: for each fraction f, the first group boundary at or past max(ceil(f * n), min_block).

    Deduplicated, so fractions below the floor all snap to the end of the first block.
    """
    bounds = np.cumsum(np.asarray(group_sizes, dtype=np.int64))
    n = int(bounds[-1])
    ends = []
    for f in sorted(fractions):
        if not 0.0 < f <= 1.0:
            raise ProbeError(f"MDL: block fractions must lie in (0, 1], got {f}")
        need = min(n, max(1, math.ceil(f * n - 1e-9), min_block))
        end = int(bounds[np.searchsorted(bounds, need)])
        if not ends or end > ends[-1]:
            ends.append(end)
    if ends[-1] != n:
        ends.append(n)
    return ends


def even_block_ends(group_sizes: Sequence[int], n_blocks: int) -> list[int]:
    """n_blocks near-equal blocks snapped to group boundaries: ends at the first boundary >= ceil(k n / n_blocks).

    Used when the geometric fractions and the first-block floor leave too few blocks on a small train split.
    """
    bounds = np.cumsum(np.asarray(group_sizes, dtype=np.int64))
    n = int(bounds[-1])
    ends: list[int] = []
    for k in range(1, n_blocks + 1):
        end = int(bounds[np.searchsorted(bounds, math.ceil(k * n / n_blocks - 1e-9))])
        if not ends or end > ends[-1]:
            ends.append(end)
    return ends


@dataclass(frozen=True)
class BlockPlan:
    """The transmission order of a split and the ends of its MDL blocks; `unplanned` says why there are too few."""

    order: np.ndarray
    ends: list[int]
    unplanned: OnlineCode | None  # the n/a codelength, where the pair groups give fewer than min_blocks blocks


def block_plan(y: np.ndarray, groups: np.ndarray, seed: int, shuffle: bool, fractions: Sequence[float],
               min_block: int, min_blocks: int) -> BlockPlan:
    """Order the pair groups for transmission and cut blocks at `fractions` (near-equal blocks where those are too
    few); one plan for the one-fit-at-a-time codelength and the batched one (prober.batched_cell)."""
    order = transmission_order(groups, seed, shuffle)
    ordered = groups[order]
    sizes = np.diff(np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1], True]))
    ends = block_ends(sizes, fractions, min(min_block, y.size // 2))
    if len(ends) < min_blocks:
        ends = even_block_ends(sizes, min_blocks)
    if len(ends) >= min_blocks:
        return BlockPlan(order, ends, None)
    return BlockPlan(order, ends, OnlineCode(
        uniform_bits=float(y.size), online_bits=None, compression=None, block_ends=tuple(ends), block_bits=(),
        na_reason=f"{sizes.size} pair groups give {len(ends)} blocks; prequential MDL needs >= {min_blocks}"))


def _label_bits(p_pos: np.ndarray, y: np.ndarray) -> float:
    """Sum of -log2 p(label) given p(label = 1) per passage."""
    return float(-np.sum(np.log2(np.clip(np.where(y == 1, p_pos, 1.0 - p_pos), 1e-300, 1.0))))


def _log_sigmoid_bits(z: np.ndarray, y: np.ndarray) -> float:
    """Sum of -log2 p(label) for logits z of class 1, as log-sigmoids (no underflow at large |z|)."""
    return float(np.sum(np.logaddexp(0.0, -np.where(y == 1, 1.0, -1.0) * z)) / math.log(2.0))


def platt_scaling(z: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(a, b) of p(1 | z) = sigmoid(a z + b) by maximum likelihood on Platt's smoothed targets.

    Targets (N+ + 1) / (N+ + 2) and 1 / (N- + 2) keep the fit finite when the logits separate the labels.
    """
    z, y = np.asarray(z, dtype=np.float64), np.asarray(y)
    n_pos, n_neg = int(np.sum(y == 1)), int(np.sum(y == 0))
    t = np.where(y == 1, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    scale = float(z.std()) or 1.0
    zs = z / scale

    def loss(ab: np.ndarray) -> tuple[float, np.ndarray]:
        u = ab[0] * zs + ab[1]
        value = float(np.sum(np.logaddexp(0.0, u) - t * u))
        r = expit(u) - t
        return value, np.array([float(r @ zs), float(r.sum())])

    prior = math.log((n_pos + 1.0) / (n_neg + 1.0))
    fit = minimize(loss, np.array([0.0, prior]), jac=True, method="L-BFGS-B", options={"gtol": 1e-10})
    return float(fit.x[0] / scale), float(fit.x[1])


def _decision(model, X: np.ndarray) -> np.ndarray:
    """The probe's logit for class 1: its decision function, or the log-odds of predict_proba."""
    if hasattr(model, "decision_function"):
        return np.asarray(model.decision_function(X), dtype=np.float64)
    p = np.clip(np.asarray(model.predict_proba(X), dtype=np.float64)[:, -1], 1e-300, 1.0 - 1e-16)
    return np.log(p) - np.log1p(-p)


def _calibrated_bits(X: np.ndarray, y: np.ndarray, groups: np.ndarray, start: int, end: int,
                     probe: ProbeFactory, seed: int, folds: int) -> float | None:
    """Bits for passages [start, end) from the fold models of the prefix [0, start), Platt-calibrated on their
    own pair-grouped out-of-fold logits and averaged; None when the prefix is too small to cross-validate."""
    y_prefix, g_prefix = y[:start], groups[:start]
    n_pos = int(y_prefix.sum())
    if min(n_pos, start - n_pos) < folds or np.unique(g_prefix).size < folds:
        return None
    oof = np.empty(start)
    block = []
    for fit_idx, val_idx in stratified_group_splits(y_prefix, g_prefix, folds, seed):
        if np.unique(y_prefix[fit_idx]).size < 2:
            return None
        model = probe(seed).fit(X[fit_idx], y_prefix[fit_idx])
        oof[val_idx] = _decision(model, X[val_idx])
        block.append(_decision(model, X[start:end]))
    a, b = platt_scaling(oof, y_prefix)
    return _label_bits(np.mean(expit(a * np.asarray(block) + b), axis=0), y[start:end])


def online_codelength(X: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None, *, seed: int = 0,
                      probe: ProbeFactory = make_logistic_probe, fractions: Sequence[float] = MDL_FRACTIONS,
                      shuffle: bool = True, min_block: int = MDL_MIN_BLOCK,
                      calibration_folds: int = MDL_CALIBRATION_FOLDS,
                      min_blocks: int = MDL_MIN_BLOCKS) -> OnlineCode:
    """Prequential codelength of binary labels y given X, and compression = n bits / online bits.

    The first block holds at least min(min_block, n / 2) passages. `calibration_folds=0` sends each block with
    the raw probe's probabilities (Voita & Titov's plain code), when its prefix holds both classes. A block
    whose prefix cannot be fitted (one class) or cross-validated is sent with the uniform code (1 bit a label).
    When those blocks number fewer than `min_blocks`, `min_blocks` near-equal blocks replace them; a split with
    fewer pair groups than that gets no codelength (compression None, `na_reason` saying why).
    """
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y)
    groups = np.arange(y.size) if groups is None else np.asarray(groups)
    if X.ndim != 2 or y.shape != (X.shape[0],) or groups.shape != y.shape:
        raise ProbeError(f"MDL: X {X.shape}, y {y.shape}, groups {groups.shape} do not match")
    if not np.all(np.isin(y, (0, 1))):
        raise ProbeError("MDL: labels must be 0/1")
    plan = block_plan(y, groups, seed, shuffle, fractions, min_block, min_blocks)
    if plan.unplanned is not None:
        return plan.unplanned
    order, ends = plan.order, plan.ends
    X, y, groups = X[order], y[order], groups[order]
    bits = [float(ends[0])]
    for start, end in itertools.pairwise(ends):
        block: float | None = None
        if np.unique(y[:start]).size == 2:
            if calibration_folds:
                block = _calibrated_bits(X, y, groups, start, end, probe, seed, calibration_folds)
            else:
                block = _log_sigmoid_bits(_decision(probe(seed).fit(X[:start], y[:start]), X[start:end]),
                                          y[start:end])
        bits.append(float(end - start) if block is None else block)
    online = float(sum(bits))
    return OnlineCode(uniform_bits=float(y.size), online_bits=online, compression=y.size / online,
                      block_ends=tuple(ends), block_bits=tuple(bits))
