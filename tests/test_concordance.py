"""Kendall's W across models: against scipy's Friedman statistic, on known rankings, and under the null."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import friedmanchisquare, kstest, spearmanr

from poolbench.prober.auroc import ProbeError
from poolbench.prober.concordance import (
    bootstrap_interval,
    concordance,
    kendall_w,
    permutation_p_value,
)


def friedman_w(scores: np.ndarray) -> float:
    """W from scipy: Friedman's tie-corrected χ² over models (blocks) and strategies, divided by m(n − 1)."""
    m, n = scores.shape
    statistic, _ = friedmanchisquare(*scores.T)
    return float(statistic) / (m * (n - 1))


@pytest.mark.parametrize("seed", range(6))
def test_w_matches_scipy_friedman_with_and_without_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m, n = 2 + seed % 3, 4 + seed
    scores = rng.random((m, n))
    if seed % 2:  # ties within models: values rounded to one decimal collide
        scores = np.round(scores * 3) / 3
    # Both sides sum the same m·n ranks in float64: agreement to ~1e-12 relative, far inside 1e-9.
    assert kendall_w(scores) == pytest.approx(friedman_w(scores), rel=1e-9, abs=1e-12)


def test_two_models_w_is_half_of_one_plus_spearman() -> None:
    """For m = 2 raters W = (1 + ρ_s) / 2, a second, independent identity."""
    rng = np.random.default_rng(3)
    scores = rng.random((2, 12))
    rho = spearmanr(scores[0], scores[1]).statistic
    assert kendall_w(scores) == pytest.approx((1 + rho) / 2, abs=1e-12)


def test_identical_rankings_give_w_one_and_small_p() -> None:
    base = np.linspace(0.5, 0.9, 10)
    scores = np.stack([base, base + 0.05, base * 0.9])  # different values, the same order
    assert kendall_w(scores) == pytest.approx(1.0, abs=1e-12)
    # Under the null P(W = 1) = (1/n!)^(m-1) ~ 1e-13, so only the observed ranking itself reaches it: p = 1/(1+B).
    assert permutation_p_value(scores, n_permutations=999) == pytest.approx(1 / 1000)


def test_reversed_rankings_of_two_models_give_w_zero() -> None:
    base = np.arange(8.0)
    assert kendall_w(np.stack([base, -base])) == pytest.approx(0.0, abs=1e-12)


def test_independent_rankings_give_w_near_zero_and_uniform_p_values() -> None:
    """Should come out bad: unrelated rankings of 17 strategies by 3 models. E[W] = 1/m under the null; p-values
    over 300 simulated nulls must look uniform (KS), and W on 40 models is near 0 (E[W] = 1/40)."""
    rng = np.random.default_rng(11)
    ps = np.array([permutation_p_value(rng.random((3, 17)), n_permutations=199, seed=i) for i in range(300)])
    # p takes values k/200: KS against the continuous uniform is exact to within 1/200 per point; 300 draws
    # reject a truly uniform sample at 1e-3 once in a thousand runs, and the seeds are fixed.
    assert kstest(ps, "uniform").pvalue > 1e-3
    assert 0.35 < ps.mean() < 0.65
    w_many = kendall_w(rng.random((40, 17)))
    # Var[W] under the null ≈ 2(m−1)/(m³(n−1)) → sd ≈ 0.0087 at m=40, n=17: 0.06 is ~4 sd above 1/40.
    assert w_many < 0.06


def test_bootstrap_interval_is_tight_when_models_agree_on_every_concept_and_wide_when_they_do_not() -> None:
    rng = np.random.default_rng(5)
    strengths = np.linspace(0.55, 0.95, 6)
    agree = strengths[None, :, None] + 0.01 * rng.standard_normal((3, 6, 12))
    low, high = bootstrap_interval(agree, n_bootstrap=300)
    assert low is not None and high is not None and low > 0.9 and high == pytest.approx(1.0)
    noise = rng.random((3, 6, 12))  # no strategy effect at all: resampled W stays well below 1
    low, high = bootstrap_interval(noise, n_bootstrap=300)
    assert low is not None and high is not None and low < 0.3 and high < 0.95


def test_concordance_record_and_bad_input() -> None:
    # Three models: P(W = 1) under the null is (1/5!)² ≈ 7e-5, so no permutation of 99 reaches it: p = 1/100.
    values = np.linspace(0.5, 0.9, 5)[None, :, None] + np.zeros((3, 5, 4))
    result = concordance(values, n_permutations=99, n_bootstrap=50)
    assert (result.w, result.p_value, result.n_models, result.n_strategies, result.n_concepts) == (1.0, 0.01, 3, 5, 4)
    assert result.to_dict()["kendall_w"] == 1.0
    assert bootstrap_interval(values[:, :, :1]) == (None, None)  # one concept: nothing to resample
    with pytest.raises(ProbeError, match="models x >= 2 strategies"):
        kendall_w(np.ones((1, 4)))
    with pytest.raises(ProbeError, match="finite"):
        bootstrap_interval(np.full((2, 3, 4), np.nan))
    assert np.isnan(kendall_w(np.ones((2, 4))))  # every strategy tied in every model: W undefined
