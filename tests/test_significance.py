"""Friedman/Nemenyi vs scipy and Demšar's table; paired bootstrap vs DeLong; fast DeLong vs its definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import friedmanchisquare

from poolbench.prober.auroc import auroc
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
    dl = delong_test(a, b, labels)
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
    assert delong_test(s, s, labels).p_value == 1.0
