"""A probe's scores computed once per distinct input row, so identical passages get bit-identical scores.

Pooled vectors repeat: P2_first is the same vector for every passage that opens with the same token, and the
fallbacks of the filtered strategies coincide too (make run's P2_first cells hold 7-11 distinct rows of 36). A
matrix product does not promise equal results for equal rows: a row's place in the kernel's tiles decides its
rounding, so two equal rows can score 1 ulp apart, and AUROC, which counts such a pair as ordered instead of tied,
moves by up to a whole pair's weight. On make run the batched fits (one GEMM over every row) and the per-fit path
(one GEMV per fold) disagreed on 24 of 102 P2_first cells this way (CV AUROC 0.544 against the exact 0.500).
Scoring the distinct rows and spreading the scores back makes ties ties on every kernel and device."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def _distinct(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(X's distinct rows, each row's index among them), or None when every row is distinct (score X as given)."""
    if X.ndim != 2 or X.shape[0] < 2:
        return None
    distinct, inverse = torch.unique(X, dim=0, return_inverse=True)
    return None if distinct.shape[0] == X.shape[0] else (distinct, inverse)


def score_distinct_rows(score: Callable[[torch.Tensor], torch.Tensor], X: torch.Tensor) -> torch.Tensor:
    """`score` (rows -> [..., rows]) of X's distinct rows, gathered back to X's rows along the last axis."""
    found = _distinct(X)
    if found is None:
        return score(X)
    distinct, inverse = found
    return score(distinct).index_select(-1, inverse)


def score_distinct_rows_np(score: Callable[[np.ndarray], np.ndarray], X: np.ndarray) -> np.ndarray:
    """score_distinct_rows for numpy rows and a numpy score (torch.unique: ~10x faster than np.unique on rows)."""
    X = np.ascontiguousarray(X)
    found = _distinct(torch.from_numpy(X))
    if found is None:
        return score(X)
    distinct, inverse = found
    return np.asarray(score(distinct.numpy()))[..., inverse.numpy()]
