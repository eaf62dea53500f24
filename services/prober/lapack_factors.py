"""Cholesky factors of a batch of symmetric positive definite matrices on a CPU, made in place by LAPACK.

Why not torch.linalg.cholesky and torch.cholesky_solve: on a CPU torch copies a batch into column-major order before
potrf, zeroes the factor's upper triangle after it (`tril`) and copies the factor again for every solve
(`cloneBatchedColumnMajor`). For the batched Newton solver's float32 dual matrices at the full corpus ([fits, M, M],
M ≈ 1,120: ~125 MB for D1's 25 fold fits) those are three passes over memory beside each factorization, and
a cell factors them ~80 times: in a profile of one cell (d 4,096, n 1,400, one thread) `tril` alone took 0.68 s
beside 1.76 s of factorization. Here scipy's LAPACK works on each matrix where it lies: a symmetric row-major matrix
read column-major is the same matrix, so potrf's upper factor U, written over that column-major view, is the lower
factor L = Uᵀ in torch's row-major view; the other triangle keeps the matrix's own entries, which potrs never reads.

scipy's OpenBLAS is a different LAPACK from torch's (MKL on x86): factors differ at float32 round-off, within the
backward-error bound tests/test_lapack_factors.py holds them to, as on a different CPU. Its threads follow torch's
intra-op count, so a probe task that holds one core uses one.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import lapack
from threadpoolctl import ThreadpoolController

_BLAS = ThreadpoolController()


def _as_rows(A: torch.Tensor, name: str) -> np.ndarray:
    """A [P, M, M] or [P, M, K] CPU tensor as the numpy array over its memory (no copy)."""
    if A.device.type != "cpu" or A.ndim != 3 or not A.is_contiguous() or A.dtype not in (torch.float32,
                                                                                          torch.float64):
        raise ValueError(f"{name}: expected a contiguous [P, M, ·] float32/float64 CPU tensor, got "
                         f"{tuple(A.shape)} {A.dtype} on {A.device} (contiguous: {A.is_contiguous()})")
    return A.numpy()


def factor_in_place(A: torch.Tensor) -> torch.Tensor:
    """Overwrite each A[p] ([P, M, M], symmetric positive definite) with its Cholesky factor L_p (lower triangle;
    the strict upper triangle keeps A's entries) and return A. A matrix that is not positive definite raises
    torch.linalg.LinAlgError, as torch.linalg.cholesky does (A is then partly overwritten)."""
    arrays = _as_rows(A, "factor_in_place")
    if arrays.shape[1] != arrays.shape[2]:
        raise ValueError(f"factor_in_place: matrices must be square, got {tuple(A.shape)}")
    (potrf,) = lapack.get_lapack_funcs(("potrf",), (arrays,))
    with _BLAS.limit(limits=torch.get_num_threads(), user_api="blas"):
        for p in range(arrays.shape[0]):
            view = arrays[p].T  # column-major: the same symmetric matrix
            factor, info = potrf(view, lower=0, overwrite_a=1, clean=0)
            if info > 0:
                raise torch.linalg.LinAlgError(
                    f"linalg.cholesky: (Batch element {p}): The factorization could not be completed because the "
                    f"input is not positive-definite (the leading minor of order {info} is not positive-definite).")
            if info < 0:
                raise ValueError(f"potrf: argument {-info} is invalid")
            if not np.shares_memory(factor, view):  # f2py copied after all: put the factor where it belongs
                view[...] = factor
    return A


def solve(L: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """X [P, M, K] with L_p L_pᵀ X_p = B_p for factors L [P, M, M] from factor_in_place (only their lower triangles
    are read), as torch.cholesky_solve(B, L) computes."""
    factors, rhs = _as_rows(L, "solve"), _as_rows(B, "solve")
    if rhs.shape[:2] != factors.shape[:2] or factors.dtype != rhs.dtype:
        raise ValueError(f"solve: factors {tuple(L.shape)} {L.dtype} and right-hand sides {tuple(B.shape)} {B.dtype} "
                         "do not match")
    (potrs,) = lapack.get_lapack_funcs(("potrs",), (factors,))
    out = np.empty_like(rhs)
    with _BLAS.limit(limits=torch.get_num_threads(), user_api="blas"):
        for p in range(factors.shape[0]):
            x, info = potrs(factors[p].T, rhs[p], lower=0)
            if info != 0:
                raise ValueError(f"potrs: argument {-info} is invalid")
            out[p] = x
    return torch.from_numpy(out)
