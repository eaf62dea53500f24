"""lapack_factors, the CPU's in-place Cholesky of the batched Newton solver, against torch.linalg's own.

Bounds from the arithmetic: a backward-stable Cholesky of an SPD A gives L̂ with L̂L̂ᵀ = A + E, |E| ≤ c·M·eps·|L||Lᵀ|
(Higham, Thm 10.3), so two LAPACKs' factors differ by ~M·eps relative to ‖L‖ and solves by ~cond(A)·M·eps; the
matrices here have cond ≤ ~50, M ≤ 300."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolbench.prober.lapack_factors import factor_in_place, solve


def _spd(P: int, M: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(P, M, 2 * M, generator=g, dtype=torch.float64) / np.sqrt(2 * M)
    return (torch.eye(M, dtype=torch.float64) + Z @ Z.transpose(1, 2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_factors_in_place_equal_torch_s_and_keep_the_upper_triangle(dtype):
    A = _spd(4, 300, dtype)
    expected = torch.linalg.cholesky(A)
    work = A.clone()
    pointer = work.data_ptr()
    out = factor_in_place(work)
    assert out.data_ptr() == pointer  # the matrices' own memory: no copy
    eps = torch.finfo(dtype).eps
    lower = torch.tril(out)
    assert ((lower - expected).abs().max() / expected.abs().max()).item() < 300 * 8 * eps
    strict_upper = torch.triu(torch.ones(300, 300, dtype=torch.bool), diagonal=1)
    assert torch.equal(out[:, strict_upper], A[:, strict_upper])  # potrs never reads it; it is A's own
    rebuilt = lower.double() @ lower.double().transpose(1, 2)
    assert ((rebuilt - A.double()).abs().max() / A.double().abs().max()).item() < 300 * 8 * eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solves_equal_torch_cholesky_solve(dtype):
    A = _spd(5, 200, dtype, seed=1)
    B = torch.randn(5, 200, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    expected = torch.cholesky_solve(B, torch.linalg.cholesky(A))
    got = solve(factor_in_place(A.clone()), B)
    eps = torch.finfo(dtype).eps
    assert got.dtype == dtype and got.shape == B.shape
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 50 * 200 * 8 * eps
    residual = A.double() @ got.double() - B.double()
    assert (residual.abs().max() / B.double().abs().max()).item() < 50 * 200 * 8 * eps


def test_a_matrix_that_is_not_positive_definite_raises_torch_s_error_naming_it():
    A = _spd(3, 50, torch.float32)
    A[1, 10, 10] = -5.0
    with pytest.raises(torch.linalg.LinAlgError, match=r"Batch element 1\).*order 11"):
        factor_in_place(A)


def test_a_view_that_is_not_contiguous_is_refused_not_copied():
    A = _spd(2, 20, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        factor_in_place(A.transpose(1, 2)[:, :10, :10])
