"""Prequential (online) minimum description length of a probe (Voita & Titov 2020).

Labels are sent block by block in a fixed order: the first block with the uniform code (1 bit per binary
label), every later block with the probe trained on all passages before it, costing -log2 p(label) bits
each. A concept the representation makes easy to learn compresses well: compression = uniform / online.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poolbench.prober.auroc import ProbeError
from poolbench.prober.newton_logistic import newton_logistic
from poolbench.prober.seed_spread import ProbeFactory

MDL_FRACTIONS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.0625, 0.125, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class OnlineCode:
    """Codelengths in bits; block_ends[i] is the exclusive end of block i in the transmission order."""

    uniform_bits: float
    online_bits: float
    compression: float
    block_ends: tuple[int, ...]
    block_bits: tuple[float, ...]


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


def block_ends(group_sizes: Sequence[int], fractions: Sequence[float] = MDL_FRACTIONS) -> list[int]:
    """Block boundaries: for each fraction f, the first group boundary at or past ceil(f * n), deduplicated.

    Tiny fractions of a small train set (0.1% of 160 passages) all snap to the end of the first group.
    """
    bounds = np.cumsum(np.asarray(group_sizes, dtype=np.int64))
    n = int(bounds[-1])
    ends = []
    for f in sorted(fractions):
        if not 0.0 < f <= 1.0:
            raise ProbeError(f"MDL: block fractions must lie in (0, 1], got {f}")
        need = max(1, math.ceil(f * n - 1e-9))
        end = int(bounds[np.searchsorted(bounds, need)])
        if not ends or end > ends[-1]:
            ends.append(end)
    if ends[-1] != n:
        ends.append(n)
    return ends


def _label_bits(model, X: np.ndarray, y: np.ndarray) -> float:
    """Sum of -log2 p(y | x); log-sigmoid of the decision function when there is one (no underflow)."""
    if hasattr(model, "decision_function"):
        z = np.asarray(model.decision_function(X), dtype=np.float64)
        sign = np.where(y == model.classes_[1], 1.0, -1.0)
        return float(np.sum(np.logaddexp(0.0, -sign * z)) / math.log(2.0))
    proba = np.asarray(model.predict_proba(X), dtype=np.float64)
    col = np.searchsorted(model.classes_, y)
    p = np.clip(proba[np.arange(y.size), col], 1e-300, 1.0)
    return float(-np.sum(np.log2(p)))


def online_codelength(X: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None, *, seed: int = 0,
                      probe: ProbeFactory = newton_logistic, fractions: Sequence[float] = MDL_FRACTIONS,
                      shuffle: bool = True) -> OnlineCode:
    """Prequential codelength of binary labels y given X, and compression = n bits / online bits.

    A block whose preceding passages hold fewer than two classes cannot train a probe and is sent with the
    uniform code too (1 bit per label).
    """
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y)
    groups = np.arange(y.size) if groups is None else np.asarray(groups)
    if X.ndim != 2 or y.shape != (X.shape[0],) or groups.shape != y.shape:
        raise ProbeError(f"MDL: X {X.shape}, y {y.shape}, groups {groups.shape} do not match")
    if not np.all(np.isin(y, (0, 1))):
        raise ProbeError("MDL: labels must be 0/1")
    order = transmission_order(groups, seed, shuffle)
    X, y, groups = X[order], y[order], groups[order]
    sizes = np.diff(np.flatnonzero(np.r_[True, groups[1:] != groups[:-1], True]))
    ends = block_ends(sizes, fractions)
    bits = [float(ends[0])]
    for start, end in itertools.pairwise(ends):
        if np.unique(y[:start]).size < 2:
            bits.append(float(end - start))
            continue
        model = probe(seed).fit(X[:start], y[:start])
        bits.append(_label_bits(model, X[start:end], y[start:end]))
    online = float(sum(bits))
    return OnlineCode(uniform_bits=float(y.size), online_bits=online, compression=y.size / online,
                      block_ends=tuple(ends), block_bits=tuple(bits))
