"""logsumexp_rows against torch.logsumexp: the same bits at the vocabularies the project runs (multiples of 64) on one
and two threads, a few ulps at an odd width, torch's answers for infinite rows, and the cases it hands to torch
untouched."""

from __future__ import annotations

import math

import pytest
import torch

from poolbench.extractor.logsumexp_rows import logsumexp_rows


def _logits(rows: int, width: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=generator, dtype=torch.float64) * 4.0).to(dtype)


@pytest.mark.usefixtures("torch_threads")
@pytest.mark.parametrize("width", [49_152, 262_144, 4_096])
@pytest.mark.parametrize("rows", [65, 66, 130, 200])
def test_same_bits_as_torch_at_vocabulary_widths(rows: int, width: int) -> None:
    logits = _logits(rows, width, seed=rows + width)
    expected = torch.logsumexp(logits, dim=-1)
    got = logsumexp_rows(logits)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


@pytest.mark.parametrize("torch_threads", [1, 2], indirect=True)
@pytest.mark.usefixtures("torch_threads")
def test_same_bits_with_one_and_two_threads_and_small_blocks() -> None:
    logits = _logits(37, 49_152, seed=3)
    assert torch.equal(logsumexp_rows(logits, block_rows=4), torch.logsumexp(logits, dim=-1))
    double = _logits(37, 4_096, seed=4, dtype=torch.float64)
    assert torch.equal(logsumexp_rows(double, block_rows=8), torch.logsumexp(double, dim=-1))


def test_within_a_few_ulps_at_an_odd_width() -> None:
    """50,257 words (GPT-2's): a block's share of elements need not be whole SIMD vectors, so an element may take
    the scalar exp (both within 1 ulp): the sum of ~50k terms moves by a few ulps of the result at most."""
    logits = _logits(150, 50_257, seed=5)
    expected, got = torch.logsumexp(logits, dim=-1), logsumexp_rows(logits, block_rows=16)
    ulp = torch.finfo(torch.float32).eps * expected.abs()
    assert bool(((got - expected).abs() <= 4 * ulp).all())


@pytest.mark.usefixtures("torch_threads")
def test_infinite_rows_as_torch_gives_them() -> None:
    logits = _logits(70, 1_024, seed=6)
    logits[3] = -math.inf  # every word impossible: -inf, not nan
    logits[40, 7] = math.inf
    logits[41, :5] = -math.inf
    expected, got = torch.logsumexp(logits, dim=-1), logsumexp_rows(logits, block_rows=8)
    assert got[3] == -math.inf and got[40] == math.inf
    assert torch.equal(got, expected)


def test_other_inputs_are_torchs_own_call() -> None:
    few = _logits(10, 300, seed=7)  # a single block
    assert torch.equal(logsumexp_rows(few), torch.logsumexp(few, dim=-1))
    half = _logits(100, 320, seed=8, dtype=torch.bfloat16)
    assert torch.equal(logsumexp_rows(half, block_rows=8), torch.logsumexp(half, dim=-1))
    strided = _logits(320, 100, seed=9).t()
    assert torch.equal(logsumexp_rows(strided, block_rows=8), torch.logsumexp(strided, dim=-1))


@pytest.mark.usefixtures("torch_threads")
def test_a_wrong_shift_is_caught() -> None:
    """The equality above is not vacuous: the log-sum-exp of rows shifted by one ulp's worth differs."""
    logits = _logits(130, 4_096, seed=10)
    assert not torch.equal(logsumexp_rows(logits * (1 + 2**-20)), torch.logsumexp(logits, dim=-1))
