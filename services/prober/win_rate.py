"""Mean win rate (HELM, Holmes): how often a strategy beats another on the same comparison unit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.prober.auroc import ProbeError


def mean_win_rate(scores: np.ndarray, strategies: Sequence[str]) -> dict[str, float | None]:
    """Per strategy, the mean over units of the fraction of other strategies it beats there (tie = 1/2).

    scores is [n_units, n_strategies], higher is better, NaN = not run; a unit counts for a strategy when it
    and at least one rival were run there. With every cell present this equals the fraction of all its
    head-to-head comparisons won; a strategy never compared gets None.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[1] != len(strategies):
        raise ProbeError(f"win rate: scores {scores.shape} do not match {len(strategies)} strategies")
    if len(strategies) < 2:
        raise ProbeError("win rate: needs at least two strategies")
    a, b = scores[:, :, None], scores[:, None, :]
    valid = ~np.isnan(a) & ~np.isnan(b)
    valid &= ~np.eye(len(strategies), dtype=bool)[None, :, :]
    points = np.where(valid, (a > b) + 0.5 * (a == b), 0.0).sum(axis=2)
    rivals = valid.sum(axis=2)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_unit = np.where(rivals > 0, points / np.maximum(rivals, 1), np.nan)
    out = {}
    for j, name in enumerate(strategies):
        column = per_unit[:, j]
        out[name] = float(np.nanmean(column)) if np.any(~np.isnan(column)) else None
    return out
