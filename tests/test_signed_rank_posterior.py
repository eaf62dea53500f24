"""The Bayesian signed-rank twin against baycomp itself: the same draws, the same sums, the same probabilities."""

import numpy as np
import pytest
from baycomp import SignedRankTest

from poolbench.prober import signed_rank_posterior
from poolbench.prober.signed_rank_posterior import signed_rank_probs, signed_rank_samples
from poolbench.prober.verdicts import bayesian_signed_rank


def _cases():
    # Pair sums exactly at 2 x ROPE, where baycomp's Heaviside counts half: 0.01 + 0.01 == 2 x 0.01 in binary too.
    yield np.zeros(4), np.array([0.01, 0.01, 0.03, -0.01])
    rng = np.random.default_rng(11)
    for n in (1, 2, 5, 17, 40):
        x = rng.uniform(0.5, 1.0, n)
        yield x, x + rng.normal(0.0, 0.02, n)  # differences around the ROPE: every region wins some draws
        rounded = np.round(x, 2)
        yield rounded, np.round(rounded + rng.normal(0.0, 0.02, n), 2)


@pytest.mark.numerics  # numpy's reductions under other kernel sets too (make test's CPU profiles)
@pytest.mark.parametrize("rope", [0.01, 0.005])
def test_equal_to_baycomp_bit_for_bit(rope):
    for seed, (x, y) in enumerate(_cases()):
        assert np.array_equal(signed_rank_samples(x, y, rope, nsamples=3000, seed=seed),
                              SignedRankTest.sample(x, y, rope, nsamples=3000, random_state=seed))
        want = tuple(float(p) for p in SignedRankTest.probs(x, y, rope=rope, nsamples=3000, random_state=seed))
        assert signed_rank_probs(x, y, rope, nsamples=3000, seed=seed) == want


@pytest.mark.numerics
def test_blocks_do_not_change_the_sums(monkeypatch):
    # A block of one draw and a block of every draw: the same numbers, so the block size is only about memory.
    rng = np.random.default_rng(5)
    x = rng.uniform(0.6, 0.9, 17)
    y = x + rng.normal(0.0, 0.015, 17)
    whole = signed_rank_samples(x, y, 0.01, nsamples=999, seed=2)
    monkeypatch.setattr(signed_rank_posterior, "BLOCK_BYTES", 1)
    assert np.array_equal(signed_rank_samples(x, y, 0.01, nsamples=999, seed=2), whole)
    assert np.array_equal(whole, SignedRankTest.sample(x, y, 0.01, nsamples=999, random_state=2))


def test_the_verdicts_read_it_in_their_order():
    # bayesian_signed_rank(best, other) is baycomp's probs(other, best) reversed: P(best better) first.
    rng = np.random.default_rng(3)
    best = rng.uniform(0.7, 0.9, 12)
    other = best - rng.uniform(0.0, 0.04, 12)
    left, inside, right = SignedRankTest.probs(other, best, rope=0.01, nsamples=2000, random_state=4)
    assert bayesian_signed_rank(best, other, 0.01, nsamples=2000, seed=4) == (float(right), float(inside), float(left))
    assert right > left  # best is higher on every concept: its region wins more draws


@pytest.mark.parametrize("x, y, rope, nsamples", [(np.zeros(3), np.zeros(4), 0.01, 10),
                                                  (np.zeros((2, 2)), np.zeros((2, 2)), 0.01, 10),
                                                  (np.zeros(3), np.zeros(3), 0.0, 10),
                                                  (np.zeros(3), np.zeros(3), 0.01, 0)])
def test_bad_input_names_what_is_wrong(x, y, rope, nsamples):
    with pytest.raises(ValueError, match="signed_rank_posterior"):
        signed_rank_probs(x, y, rope, nsamples=nsamples, seed=0)
