"""First-order steerability and its rank agreement with D1, on constructed gradients with hand-computed answers."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_float32_close

from poolbench.steerer.errors import SteeringError
from poolbench.steerer.steerability import (
    exact_steerability,
    first_order_steerability,
    gradient_projections,
    residual_norm_from_sums,
)
from poolbench.steerer.steerability_rank import concept_agreement, steerability_agreement

# Two positives, two negatives in 3 dimensions; u = e0.
G = np.array([[2.0, 1.0, 0.0], [4.0, -1.0, 5.0], [1.0, 3.0, 0.0], [-1.0, 0.0, 2.0]])
Y = np.array([1, 1, 0, 0])
U = np.array([1.0, 0.0, 0.0])


def test_first_order_steerability_by_hand():
    # projections on e0: 2, 4 | 1, -1 -> means 3 and 0 -> S = r * 3
    assert gradient_projections(U, G).tolist() == [2.0, 4.0, 1.0, -1.0]
    assert first_order_steerability(U, 10.0, G, Y) == 30.0
    # a diagonal direction: projections (3, 3, 4, -1)/sqrt2 -> means 3/sqrt2 and 1.5/sqrt2 -> 1.5/sqrt2 * r
    diag = np.array([1.0, 1.0, 0.0]) / np.sqrt(2.0)
    assert_float32_close(first_order_steerability(diag, 2.0, G, Y), 2.0 * 1.5 / np.sqrt(2.0), terms=4, scale=8.0)


def test_should_fail_orthogonal_vector_gives_zero_and_reversed_flips():
    """A v orthogonal to every gradient cannot steer (0); the reversed vector steers the other way (-S)."""
    grads = np.array([[1.0, 2.0, 0.0], [3.0, -4.0, 0.0], [0.5, 0.0, 0.0], [-2.0, 7.0, 0.0]])
    assert first_order_steerability(np.array([0.0, 0.0, 1.0]), 5.0, grads, Y) == 0.0
    s = first_order_steerability(U, 1.0, G, Y)
    assert s > 0
    assert first_order_steerability(-U, 1.0, G, Y) == -s


def test_exact_steerability_matches_first_order_on_a_linear_model():
    """log p linear in h: the steered shift is exactly alpha * r * u.G, so exact == first order."""
    r, alpha = 4.0, 0.1
    base = np.array([-10.0, -12.0, -9.0, -11.0])
    steered = base + alpha * r * (G @ U)
    assert_float32_close(exact_steerability(steered, base, Y, alpha), first_order_steerability(U, r, G, Y),
                         terms=4, scale=40.0)


def test_bad_inputs_name_the_problem():
    with pytest.raises(SteeringError, match="positive and negative"):
        first_order_steerability(U, 1.0, G, np.array([1, 1, 1, 1]))
    with pytest.raises(SteeringError, match="do not match"):
        first_order_steerability(np.ones(2), 1.0, G, Y)
    with pytest.raises(SteeringError, match="alpha > 0"):
        exact_steerability(np.zeros(4), np.zeros(4), Y, 0.0)


def test_residual_norm_from_sums():
    assert residual_norm_from_sums([10.0, 20.0], [2, 3]) == 6.0
    with pytest.raises(SteeringError):
        residual_norm_from_sums([0.0], [0])


def test_concept_agreement_by_hand():
    d1 = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.6}
    assert concept_agreement("x", d1, {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}).rho == 1.0
    assert concept_agreement("x", d1, {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}).rho == -1.0
    # ranks of steerability (2, 1, 4, 3) against (4, 3, 2, 1): d = (2, 2, 2, 2) -> rho = 1 - 6*16/(4*15) = -0.6
    assert concept_agreement("x", d1, {"a": 2.0, "b": 1.0, "c": 4.0, "d": 3.0}).rho == pytest.approx(-0.6, abs=1e-12)
    # a null steerability leaves the strategy out; two left is too few
    short = concept_agreement("x", d1, {"a": 1.0, "b": None, "c": None, "d": 4.0})
    assert short.rho is None and short.n_strategies == 2


def test_agreement_mean_and_interval_over_concepts():
    d1 = {"a": 0.9, "b": 0.8, "c": 0.7}
    steer = {"a": 3.0, "b": 2.0, "c": 1.0}
    rev = {"a": 1.0, "b": 2.0, "c": 3.0}
    # four concepts agreeing perfectly: mean 1 and a degenerate interval [1, 1]
    same = steerability_agreement({c: d1 for c in "pqrs"}, {c: steer for c in "pqrs"})
    assert (same.mean_rho, same.low, same.high, same.n_concepts) == (1.0, 1.0, 1.0, 4)
    # should fail: two agree, two disagree -> mean 0 and an interval spanning it, from -1 to 1 at the extremes
    mixed = steerability_agreement({c: d1 for c in "pqrs"}, {"p": steer, "q": steer, "r": rev, "s": rev})
    assert mixed.mean_rho == 0.0
    assert mixed.low is not None and mixed.high is not None
    assert -1.0 <= mixed.low < 0.0 < mixed.high <= 1.0
    assert "+0.00" in mixed.sentence()
    # too few concepts for an interval
    two = steerability_agreement({"p": d1, "q": d1}, {"p": steer, "q": steer})
    assert two.mean_rho == 1.0 and two.low is None and "too few concepts" in two.sentence()
