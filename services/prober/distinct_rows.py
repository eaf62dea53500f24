"""A probe's scores computed once per distinct input row, so identical passages get bit-identical scores.

Pooled vectors repeat: P2_first is the same vector for every passage that opens with the same token, and the
fallbacks of the filtered strategies coincide too (make run's P2_first cells hold 7-11 distinct rows of 36). A
matrix product does not promise equal results for equal rows: a row's place in the kernel's tiles decides its
rounding, so two equal rows can score 1 ulp apart, and AUROC, which counts such a pair as ordered instead of tied,
moves by up to a whole pair's weight. On make run the batched fits (one GEMM over every row) and the per-fit path
(one GEMV per fold) disagreed on 24 of 102 P2_first cells this way (CV AUROC 0.544 against the exact 0.500).
Scoring the distinct rows and spreading the scores back makes ties ties on every kernel and device."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}  # a float's bits as the integer of its width


def _distinct(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(X's distinct rows, each row's index among them), or None when every row is distinct (score X as given).

    On a GPU by row hashes (distinct_by_hash): torch.unique(dim=0) sorts the rows lexicographically, 3.5 ms a call
    there for [1,400 × 4,096] (9% of a D1 cell on an H200, bench/measured/h200_warm). On a CPU it stays
    torch.unique: the order of the distinct rows it scores is make run's, whose scores round by it."""
    if X.ndim != 2 or X.shape[0] < 2:
        return None
    if X.is_cuda:
        return distinct_by_hash(X)
    distinct, inverse = torch.unique(X, dim=0, return_inverse=True)
    return None if distinct.shape[0] == X.shape[0] else (distinct, inverse)


def row_hashes(X: torch.Tensor) -> torch.Tensor:
    """[rows] int64: a hash of each row's values, equal for equal rows (-0.0 and 0.0 alike), wrapping arithmetic."""
    bits = (X + 0.0).contiguous().view(_INT_OF[X.element_size()]).long()  # -0.0 + 0.0 = +0.0: one bit pattern
    mixed = bits ^ (bits >> 29)  # the exponent's bits reach the low bits the odd multipliers keep
    return (mixed * _hash_weights(X.shape[1], str(X.device))).sum(dim=1)


@functools.cache
def _hash_weights(width: int, device: str) -> torch.Tensor:
    """Odd int64 multipliers, one a column, from a fixed seed (the same hash in every process)."""
    gen = torch.Generator(device="cpu").manual_seed(0x5EED)
    return torch.randint(-(2 ** 62), 2 ** 62, (width,), generator=gen).mul_(2).add_(1).to(device)


def distinct_by_hash(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """_distinct's answer from 1-D hashes: rows with distinct hashes are distinct; rows sharing one are checked equal
    (all values), and a collision of unequal rows falls back to torch.unique(dim=0), so the partition is exact.
    The distinct rows come in hash order (each row's first appearance stands for its group)."""
    hashes, inverse = torch.unique(row_hashes(X), return_inverse=True)
    if hashes.shape[0] == X.shape[0]:
        return None
    first = torch.full((hashes.shape[0],), X.shape[0], dtype=torch.int64, device=X.device)
    first = first.scatter_reduce_(0, inverse, torch.arange(X.shape[0], device=X.device), "amin")
    distinct = X.index_select(0, first)
    if not bool((distinct.index_select(0, inverse) == X).all()):  # a hash collision between unequal rows
        distinct, inverse = torch.unique(X, dim=0, return_inverse=True)
        if distinct.shape[0] == X.shape[0]:
            return None
    return distinct, inverse


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
