"""tests/tolerances.py against real float32 round-off: sums of n terms in three orders stay inside the bound, and a
real error (a term left out, a 1e-4 relative slip) falls outside it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tolerances import EPS32, assert_float32_close, float32_atol

pytestmark = pytest.mark.numerics


def test_bound_by_hand() -> None:
    assert EPS32 == 2.0**-23
    assert float32_atol(1.0, 4, k=4) == 8 * 2.0**-23
    assert float32_atol(3.0, 100, k=1) == pytest.approx(30 * 2.0**-23, rel=1e-15)
    with pytest.raises(ValueError, match="terms"):
        float32_atol(1.0, 0)


@pytest.mark.parametrize("n", [10, 1_000, 100_000])
@pytest.mark.parametrize("signed", [False, True])
def test_float32_sums_in_three_orders_stay_inside_the_bound(n: int, signed: bool) -> None:
    rng = np.random.default_rng(n)
    x = rng.uniform(-1.0 if signed else 0.0, 1.0, n).astype(np.float32)
    exact = math.fsum(x.astype(np.float64))
    scale = float(np.abs(np.cumsum(x.astype(np.float64))).max())  # the partial sums each rounding is relative to
    forward, backward = np.cumsum(x)[-1], np.cumsum(x[::-1])[-1]  # float32 cumsum adds one term at a time
    pairwise = x.sum()  # numpy's pairwise (blocked) summation: the order another CPU's kernels may take
    for got in (forward, backward, pairwise):
        assert_float32_close(got, exact, terms=n, scale=scale)
    assert_float32_close(forward, backward, terms=n, scale=scale)


def test_a_real_error_falls_outside_the_bound() -> None:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, 1_000).astype(np.float32)
    scale = float(x.astype(np.float64).sum())
    with pytest.raises(AssertionError):
        assert_float32_close(x[1:].sum(), x.sum(), terms=x.size, scale=scale)  # one term left out
    with pytest.raises(AssertionError):
        assert_float32_close(x.sum() * np.float32(1 + 1e-4), x.sum(), terms=x.size, scale=scale)


def test_a_cancelling_sum_is_judged_by_its_terms_not_its_result() -> None:
    """Σ of +x and -x in two orders is ~0 with round-off of the terms' size: relative to the ~0 result no
    tolerance holds, relative to the terms (the scale to pass) it does."""
    rng = np.random.default_rng(1)
    x = rng.uniform(1.0, 2.0, 512).astype(np.float32)
    terms = np.concatenate([x, -x[::-1] * np.float32(1 + 2**-22)])
    one, other = np.cumsum(terms)[-1], np.cumsum(rng.permutation(terms))[-1]
    assert one != other
    scale = float(np.abs(np.cumsum(terms.astype(np.float64))).max())
    assert_float32_close(one, other, terms=terms.size, scale=scale)
    with pytest.raises(AssertionError):
        assert_float32_close(one, other, terms=terms.size)  # scale defaulted to the ~0 results: too tight


def test_records_close_takes_round_off_in_floats_and_nothing_else() -> None:
    """A perplexity exp(-mean log p) of 640 float32 log-probabilities summed in two orders stays within
    2·float32_atol(16, 640) of itself (the bound test_steering_cell_groups derives); a 1e-3 slip, another string,
    another int or a missing key does not."""
    from tolerances import assert_records_close

    logp = -np.random.default_rng(0).uniform(0, 13, size=640).astype(np.float32)
    forward = float(np.exp(-np.float32(sum(logp.tolist(), start=np.float32(0))) / 640))
    backward = float(np.exp(-np.float32(sum(logp[::-1].tolist(), start=np.float32(0))) / 640))
    rel = 2 * float32_atol(16.0, 640)
    record = {"concept": "x", "n": 3, "ok": True, "none": None, "per_alpha": [{"perplexity": forward}],
              "nan": float("nan")}
    assert_records_close({**record, "per_alpha": [{"perplexity": backward}]}, record, rel=rel)
    for wrong in ({**record, "per_alpha": [{"perplexity": forward * (1 + 1e-3)}]}, {**record, "concept": "y"},
                  {**record, "n": 4}, {**record, "n": 3.0}, {k: v for k, v in record.items() if k != "ok"}):
        with pytest.raises(AssertionError):
            assert_records_close(wrong, record, rel=rel, err_msg="d2")
