"""Friedman/Nemenyi vs scipy and Demšar's table; paired bootstrap vs DeLong; fast DeLong vs its definition; the
clustered paired DeLong by hand, against ignoring the pairs, and against a pair bootstrap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import friedmanchisquare, norm

from poolbench.prober.auroc import auroc, auroc_batch, clustered_auroc_covariance, group_bootstrap_weights
from poolbench.prober.significance import (
    delong_covariance,
    delong_test,
    friedman_nemenyi,
    nemenyi_critical_difference,
    paired_bootstrap_auroc,
)


def test_friedman_matches_scipy_and_hand_ranks():
    scores = np.array([[0.9, 0.8, 0.7], [0.85, 0.86, 0.6], [0.7, 0.7, 0.65], [0.95, 0.9, 0.5]])
    out = friedman_nemenyi(scores, ["A", "B", "C"])
    ref = friedmanchisquare(*scores.T)
    assert out["statistic"] == pytest.approx(ref.statistic) and out["p_value"] == pytest.approx(ref.pvalue)
    # ranks per unit (1 = best): A 1,2,1.5,1  B 2,1,1.5,2  C 3,3,3,3
    assert out["average_ranks"] == pytest.approx({"A": 5.5 / 4, "B": 6.5 / 4, "C": 3.0})


def test_nemenyi_q_and_cd_match_demsar_table():
    # Demšar (2006), Table 5a: q_0.05 = 2.343 for k = 3, 2.569 for k = 4, 3.164 for k = 10.
    for k, q_table in ((3, 2.343), (4, 2.569), (10, 3.164)):
        q, cd = nemenyi_critical_difference(k, 20)
        assert q == pytest.approx(q_table, abs=2e-3)
        assert cd == pytest.approx(q * math.sqrt(k * (k + 1) / 120.0))


def _naive_delong(scores: np.ndarray, pos: np.ndarray):
    """DeLong's structural components straight from the definition, O(m n)."""
    x, y = scores[:, pos], scores[:, ~pos]
    psi = (x[:, :, None] > y[:, None, :]) + 0.5 * (x[:, :, None] == y[:, None, :])
    v10, v01 = psi.mean(axis=2), psi.mean(axis=1)
    return psi.mean(axis=(1, 2)), np.cov(v10) / x.shape[1] + np.cov(v01) / y.shape[1]


def test_fast_delong_equals_its_definition_with_ties():
    rng = np.random.default_rng(0)
    labels = np.r_[np.ones(23, dtype=int), np.zeros(31, dtype=int)]
    scores = np.round(np.vstack([rng.normal(labels * 0.8), rng.normal(labels * 0.3)]), 1)
    aucs, cov = delong_covariance(scores, labels)
    ref_aucs, ref_cov = _naive_delong(scores, labels.astype(bool))
    np.testing.assert_allclose(aucs, ref_aucs, atol=1e-12)
    np.testing.assert_allclose(cov, ref_cov, atol=1e-12)
    assert aucs[0] == pytest.approx(auroc(scores[0], labels))


def test_delong_and_paired_bootstrap_agree():
    rng = np.random.default_rng(1)
    n = 300
    labels = np.r_[np.ones(n, dtype=int), np.zeros(n, dtype=int)]
    shared = rng.normal(size=2 * n)
    a = labels * 1.0 + shared + 0.5 * rng.normal(size=2 * n)
    b = labels * 0.7 + shared + 0.5 * rng.normal(size=2 * n)
    groups = np.arange(2 * n)  # unpaired: each passage its own group, as DeLong assumes
    dl = delong_test(a, b, labels, groups)
    bs = paired_bootstrap_auroc(a, b, labels, groups, n_bootstrap=2000, seed=0)
    assert dl.difference == pytest.approx(bs.difference)
    se_dl, se_bs = (dl.ci_high - dl.ci_low) / (2 * 1.96), (bs.ci_high - bs.ci_low) / (2 * 1.96)
    assert se_bs == pytest.approx(se_dl, rel=0.15)
    assert (dl.p_value < 0.05) == (bs.p_value < 0.05)


def test_paired_bootstrap_of_identical_scores_is_zero():
    rng = np.random.default_rng(2)
    labels = np.r_[np.ones(20, dtype=int), np.zeros(20, dtype=int)]
    s = rng.normal(size=40) + labels
    out = paired_bootstrap_auroc(s, s, labels, np.r_[np.arange(20), np.arange(20)], n_bootstrap=200)
    assert out.difference == 0.0 and out.ci_low == 0.0 == out.ci_high and out.p_value == 1.0
    assert delong_test(s, s, labels, np.r_[np.arange(20), np.arange(20)]).p_value == 1.0


def test_clustered_delong_test_by_hand():
    """3 pairs (pos, neg): a = (3,4), (5,2), (1,0); b = (4,0), (1,2), (5,3).
    a: positive placements 2/3, 1, 1/3, negative 1/3, 2/3, 1 -> A_a = 2/3, per-pair u = (r10 + r01)/3 = (-3, 3, 0)/27.
    b: positive placements 1, 1/3, 1, negative 1, 2/3, 2/3 -> A_b = 7/9, u = (4, -5, 1)/27.
    Cov = K/(K-1) u u^T: Var_a = 3/2 * 18/729 = 1/27, Var_b = 3/2 * 42/729 = 7/81, Cov_ab = 3/2 * -27/729 = -1/18,
    so Var(A_a - A_b) = 1/27 + 7/81 + 1/9 = 19/81 and z = (1/9) / (sqrt(19)/9) = 1/sqrt(19)."""
    a = np.array([3.0, 4, 5, 2, 1, 0])
    b = np.array([4.0, 0, 1, 2, 5, 3])
    labels, groups = np.tile([1, 0], 3), np.repeat([0, 1, 2], 2)
    out = delong_test(a, b, labels, groups)
    assert out.auroc_a == pytest.approx(2 / 3) and out.auroc_b == pytest.approx(7 / 9)
    assert out.difference == pytest.approx(-1 / 9)
    z = float(norm.ppf(0.975))
    assert out.ci_low == pytest.approx(-1 / 9 - z * math.sqrt(19) / 9)
    assert out.ci_high == pytest.approx(-1 / 9 + z * math.sqrt(19) / 9)
    assert out.p_value == pytest.approx(2 * norm.sf(1 / math.sqrt(19)))
    assert out.method == "pair_clustered_delong"
    _, cov = clustered_auroc_covariance(np.vstack([a, b]), labels, groups)
    np.testing.assert_allclose(cov, [[1 / 27, -1 / 18], [-1 / 18, 7 / 81]], atol=1e-15)


def _pair_specific_advantage(rng: np.random.Generator, k: int):
    """k matched pairs on which a and b are equally good on average, but in each pair one of them separates the
    twins better (by 2 e_g): the twins' placements move together, which passage-level DeLong ignores."""
    e, mu = rng.normal(size=k), rng.normal(size=k)
    noise = 0.5 * rng.normal(size=(4, k))
    a = np.column_stack([1 + e + mu + noise[0], -e + mu + noise[1]]).ravel()
    b = np.column_stack([1 - e + mu + noise[2], e + mu + noise[3]]).ravel()
    return a, b, np.tile([1, 0], k), np.repeat(np.arange(k), 2)


def test_ignoring_the_pairs_understates_the_variance_and_the_clustered_test_does_not():
    """Should-fail: 1,000 null data sets of 40 pairs. The empirical variance of A_a - A_b is what a variance estimate
    must match (its own Monte-Carlo relative error is sqrt(2/999) = 0.045, so 0.15 is > 3 of those); passage-level
    DeLong comes out near half of it and rejects the true null ~3x too often; the clustered one does neither."""
    rng = np.random.default_rng(0)
    diffs, clustered, independent, reject_c, reject_i = [], [], [], [], []
    for _ in range(1000):
        a, b, labels, groups = _pair_specific_advantage(rng, 40)
        out = delong_test(a, b, labels, groups)
        diffs.append(out.difference)
        clustered.append(((out.ci_high - out.ci_low) / (2 * norm.ppf(0.975))) ** 2)
        reject_c.append(out.p_value < 0.05)
        _, cov = delong_covariance(np.vstack([a, b]), labels)
        var = cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]
        independent.append(var)
        reject_i.append(2 * norm.sf(abs(out.difference) / math.sqrt(var)) < 0.05)
    truth = np.var(diffs, ddof=1)
    assert np.mean(clustered) / truth == pytest.approx(1.0, abs=0.15)
    assert np.mean(independent) / truth < 0.7
    # rejection rates of a true null at 0.05; Monte-Carlo SE sqrt(0.05 * 0.95 / 1000) = 0.007
    assert np.mean(reject_c) < 0.05 + 5 * 0.007 < 0.1 < np.mean(reject_i)


def test_clustered_delong_agrees_with_a_pair_bootstrap():
    """Independent check on one data set of 200 pairs: the pair bootstrap's variance of the difference (4,000
    resamples, times K/(K-1) for the unbiased scale) matches the clustered DeLong variance within its Monte-Carlo
    relative error sqrt(2/4000) = 0.022 (0.1 allows 4 of them and the bootstrap's O(1/K) bias); the passage-level
    DeLong variance lies well outside."""
    a, b, labels, groups = _pair_specific_advantage(np.random.default_rng(1), 200)
    out = delong_test(a, b, labels, groups)
    weights = group_bootstrap_weights(groups, labels.astype(bool), 4000, 0)
    boot = auroc_batch(a, labels, weights) - auroc_batch(b, labels, weights)
    var_boot = np.var(boot, ddof=1) * 200 / 199
    var_clustered = ((out.ci_high - out.ci_low) / (2 * norm.ppf(0.975))) ** 2
    assert var_clustered / var_boot == pytest.approx(1.0, abs=0.1)
    _, cov = delong_covariance(np.vstack([a, b]), labels)
    assert (cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]) / var_boot < 0.75
