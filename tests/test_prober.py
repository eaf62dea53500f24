"""D1: AUROC against hand-computed and theoretical values, the pair leak, folds, bootstrap CI, boundaries."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import norm
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from poolbench.errors import PoolBenchError
from poolbench.prober.auroc import auroc, auroc_batch, bootstrap_auroc_ci, group_bootstrap_weights
from poolbench.prober.d1 import ProbeError, cv_auroc, cv_splits, evaluate_d1
from poolbench.prober.newton_logistic import LOGISTIC_C, NewtonLogisticProbe
from poolbench.prober.probes import DiffMeanProbe, make_probe


def paired_data(n_pairs: int, d: int, shift: float, seed: int, prefix: str = "p"):
    """Matched pairs: a shared base vector, the positive shifted by `shift` along feature 0."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_pairs, d))
    pos = base + 0.3 * rng.normal(size=(n_pairs, d))
    neg = base + 0.3 * rng.normal(size=(n_pairs, d))
    pos[:, 0] += shift
    X = np.r_[pos, neg]
    y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
    groups = np.array([f"{prefix}{i}" for i in range(n_pairs)] * 2)
    return X, y, groups


def twin_leak_data(n_pairs: int, d: int, seed: int):
    """Each item's twin is itself plus tiny noise with the OPPOSITE label; feature 0 carries a weak signal."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_pairs, d))
    labels = rng.integers(0, 2, n_pairs)
    X = np.r_[base, base + 0.05 * rng.normal(size=(n_pairs, d))]
    y = np.r_[labels, 1 - labels]
    X[:, 0] += 0.5 * (2 * y - 1) / 2
    groups = np.r_[np.arange(n_pairs), np.arange(n_pairs)]
    return X, y, groups


# --- AUROC -----------------------------------------------------------------------------------------------


def test_auroc_hand_computed_with_a_tie():
    # pos 0.9 beats all three negatives (3); pos 0.5 ties neg 0.5 (0.5) and beats 0.2, 0.1 (2);
    # pos 0.3 beats 0.2, 0.1 (2): 7.5 of 9 pairs.
    scores = np.array([0.9, 0.5, 0.3, 0.5, 0.2, 0.1])
    labels = np.array([1, 1, 1, 0, 0, 0])
    assert auroc(scores, labels) == pytest.approx(7.5 / 9, abs=1e-15)
    # Weight 2 on pos 0.9: (2*3 + 2.5 + 2) / (4 * 3) = 10.5 / 12.
    weights = np.array([2.0, 1, 1, 1, 1, 1])
    assert auroc(scores, labels, weights) == pytest.approx(0.875, abs=1e-15)


def test_auroc_matches_sklearn_with_ties_and_weights():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(4, 400))
        scores = rng.integers(0, 6, n).astype(float)  # heavy ties
        labels = rng.integers(0, 2, n)
        labels[:2] = [0, 1]
        weights = rng.random(n) * 3
        assert abs(auroc(scores, labels) - roc_auc_score(labels, scores)) < 1e-12
        expected = roc_auc_score(labels, scores, sample_weight=weights)
        assert abs(auroc(scores, labels, weights) - expected) < 1e-12


def test_auroc_batch_equals_row_by_row():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 10, 60).astype(float)
    labels = np.r_[np.ones(30, dtype=int), np.zeros(30, dtype=int)]
    weights = rng.integers(0, 4, size=(25, 60)).astype(float)
    expected = [roc_auc_score(labels, scores, sample_weight=w) for w in weights]
    np.testing.assert_allclose(auroc_batch(scores, labels, weights), expected, atol=1e-12)


def test_diffmean_test_auroc_matches_theory():
    # 1-D: pos ~ N(1, 1), neg ~ N(0, 1), so AUROC = Phi(1 / sqrt(2)) = 0.7602.
    rng = np.random.default_rng(11)

    def draw(n):
        X = np.r_[rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)][:, None]
        return X, np.r_[np.ones(n, dtype=int), np.zeros(n, dtype=int)], np.arange(2 * n)

    X_tr, y_tr, g_tr = draw(500)
    X_te, y_te, g_te = draw(5000)
    d1 = evaluate_d1(X_tr, y_tr, g_tr, X_te, y_te, g_te, probes=("diffmean",), n_bootstrap=200)
    result = d1["diffmean"]
    theory = norm.cdf(1.0 / math.sqrt(2.0))
    assert theory == pytest.approx(0.76025, abs=1e-5)
    assert result.test_auroc == pytest.approx(theory, abs=0.015)
    assert result.cv_auroc == pytest.approx(theory, abs=0.04)
    assert result.ci_low < theory < result.ci_high


# --- probes ----------------------------------------------------------------------------------------------


def test_diffmean_probe_by_hand():
    X = np.array([[1.0, 0.0], [3.0, 2.0], [0.0, 0.0], [0.0, 2.0]])
    y = np.array([1, 1, 0, 0])
    probe = DiffMeanProbe().fit(X, y)
    # means (2, 1) and (0, 1): direction (2, 0); midpoint (1, 1) projects to 2.
    np.testing.assert_array_equal(probe.direction_, [2.0, 0.0])
    assert probe.threshold_ == 2.0
    np.testing.assert_array_equal(probe.project(np.array([[4.0, 7.0]])), [8.0])
    np.testing.assert_array_equal(probe.decision_function(np.array([[4.0, 7.0], [0.5, 0.0]])), [6.0, -1.0])
    np.testing.assert_array_equal(probe.predict(np.array([[4.0, 7.0], [0.5, 0.0]])), [1, 0])


def test_make_probe():
    # One logistic probe: the exact Newton solver at LOGISTIC_C, for D1 and every reliability statistic.
    logistic = make_probe("logistic", seed=4)
    assert isinstance(logistic, NewtonLogisticProbe)
    assert logistic.C == LOGISTIC_C == 1.0
    assert isinstance(make_probe("diffmean", 0), DiffMeanProbe)
    with pytest.raises(ProbeError, match="unknown probe 'svm'"):
        make_probe("svm", 0)


def test_logistic_probe_is_scikit_learns_optimum():
    # The Newton probe reaches the optimum scikit-learn's LogisticRegression reaches at a tight tolerance.
    X_tr, y_tr, _ = paired_data(80, d=32, shift=1.0, seed=0)
    X_te, y_te, _ = paired_data(40, d=32, shift=1.0, seed=1, prefix="t")
    ours = make_probe("logistic").fit(X_tr, y_tr)
    ref = make_pipeline(StandardScaler(), LogisticRegression(C=LOGISTIC_C, tol=1e-10, max_iter=10000))
    ref.fit(X_tr, y_tr)
    np.testing.assert_allclose(ours.decision_function(X_te), ref.decision_function(X_te), atol=1e-5)
    assert auroc(ours.decision_function(X_te), y_te) == auroc(ref.decision_function(X_te), y_te)


# --- the pair leak and the folds -------------------------------------------------------------------------


@pytest.mark.parametrize("probe", ["logistic", "diffmean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ungrouped_cv_leaks_through_twins_grouped_does_not(probe, seed):
    # A twin in the training fold carries the opposite label and nearly the same features, so an
    # ungrouped split scores the held-out item as its twin: AUROC far below chance. Over seeds 0-9 the
    # grouped AUROC stays >= 0.59 and the ungrouped <= 0.24.
    X, y, groups = twin_leak_data(n_pairs=60, d=200, seed=seed)
    grouped = cv_auroc(X, y, groups, probe, seed=seed, grouped=True)
    ungrouped = cv_auroc(X, y, groups, probe, seed=seed, grouped=False)
    assert grouped.auroc > 0.55
    assert ungrouped.auroc < 0.45


def test_no_pair_straddles_folds():
    _, y, groups = paired_data(n_pairs=30, d=4, shift=1.0, seed=0)
    singles_y = np.r_[np.ones(7, dtype=int), np.zeros(9, dtype=int)]
    y = np.r_[y, singles_y]
    groups = np.r_[groups, [f"solo{i}" for i in range(16)]]
    splits = cv_splits(y, groups, n_folds=5, seed=3)
    assert len(splits) == 5
    all_val = np.sort(np.concatenate([val for _, val in splits]))
    np.testing.assert_array_equal(all_val, np.arange(y.size))  # every passage validated exactly once
    for fit_idx, val_idx in splits:
        assert set(groups[fit_idx]).isdisjoint(groups[val_idx])
        assert set(y[val_idx]) == {0, 1}
    ungrouped = cv_splits(y, groups, n_folds=5, seed=3, grouped=False)
    assert any(not set(groups[f]).isdisjoint(groups[v]) for f, v in ungrouped)


def test_cv_is_deterministic_and_keeps_out_of_fold_scores():
    X, y, groups = paired_data(n_pairs=40, d=16, shift=1.0, seed=5)
    first = cv_auroc(X, y, groups, "logistic", seed=2)
    again = cv_auroc(X, y, groups, "logistic", seed=2)
    np.testing.assert_array_equal(first.oof_scores, again.oof_scores)
    assert first.auroc == pytest.approx(first.fold_aurocs.mean(), abs=1e-15)
    for fit_idx, val_idx in cv_splits(y, groups, 5, 2):
        model = make_probe("logistic", 2).fit(X[fit_idx], y[fit_idx])
        np.testing.assert_allclose(first.oof_scores[val_idx], model.decision_function(X[val_idx]), atol=1e-12)


# --- bootstrap CI ----------------------------------------------------------------------------------------


def noisy_scores(n_pairs: int, seed: int):
    rng = np.random.default_rng(seed)
    scores = np.r_[rng.normal(1.0, 1.0, n_pairs), rng.normal(0.0, 1.0, n_pairs)]
    labels = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
    return scores, labels, np.r_[np.arange(n_pairs), np.arange(n_pairs)]


def test_bootstrap_ci_contains_estimate_shrinks_with_n_and_is_seeded():
    small = noisy_scores(40, seed=0)
    large = noisy_scores(1000, seed=0)
    low_s, high_s = bootstrap_auroc_ci(*small, n_bootstrap=1000, seed=0)
    low_l, high_l = bootstrap_auroc_ci(*large, n_bootstrap=1000, seed=0)
    assert low_s < auroc(small[0], small[1]) < high_s
    assert low_l < auroc(large[0], large[1]) < high_l
    # The width scales like 1/sqrt(n): 25x the pairs, about a fifth of the width.
    assert (high_l - low_l) < 0.35 * (high_s - low_s)
    assert bootstrap_auroc_ci(*small, n_bootstrap=1000, seed=0) == (low_s, high_s)
    assert bootstrap_auroc_ci(*small, n_bootstrap=1000, seed=1) != (low_s, high_s)
    assert bootstrap_auroc_ci(*small, n_bootstrap=1000, seed=0, level=0.5) > (low_s, -1.0)


def test_bootstrap_resamples_pairs_together():
    labels = np.array([1, 0, 1, 0, 1, 0, 0])
    groups = np.array(["a", "a", "b", "b", "c", "c", "solo"])
    weights = group_bootstrap_weights(groups, labels, n_bootstrap=500, seed=0)
    assert weights.shape == (500, 7)
    np.testing.assert_array_equal(weights[:, 0], weights[:, 1])
    np.testing.assert_array_equal(weights[:, 2], weights[:, 3])
    np.testing.assert_array_equal(weights[:, 4], weights[:, 5])
    # Each row draws 4 groups: the weights of one passage per group sum to 4.
    np.testing.assert_array_equal(weights[:, [0, 2, 4, 6]].sum(axis=1), np.full(500, 4.0))
    assert not np.array_equal(weights[:, 0], weights[:, 2])


def test_bootstrap_redraws_one_class_resamples():
    # One positive among 19 negatives: about 37% of raw draws miss it; every kept row must hold it.
    labels = np.r_[1, np.zeros(19, dtype=int)]
    weights = group_bootstrap_weights(np.arange(20), labels, n_bootstrap=1000, seed=0)
    assert weights.shape == (1000, 20)
    assert np.all(weights[:, 0] >= 1)
    values = auroc_batch(np.linspace(0, 1, 20), labels, weights)
    assert np.all(np.isfinite(values))


# --- evaluate_d1 -----------------------------------------------------------------------------------------


def test_perfect_separation_gives_one_and_a_flagged_ci_below_one():
    X_tr, y_tr, g_tr = paired_data(40, d=8, shift=50.0, seed=0)
    X_te, y_te, g_te = paired_data(20, d=8, shift=50.0, seed=1, prefix="t")
    result = evaluate_d1(X_tr, y_tr, g_tr, X_te, y_te, g_te)
    for name in ("logistic", "diffmean"):
        probe = result[name]
        assert probe.cv_auroc == 1.0
        np.testing.assert_array_equal(probe.cv_fold_aurocs, np.ones(5))
        assert probe.test_auroc == 1.0
        # Wilson at p = 1 on min(20, 20) units: 20 / (20 + z^2), flagged as resting on the worst-case bound
        assert probe.ci_degenerate and probe.ci_high == 1.0
        assert probe.ci_low == pytest.approx(20 / (20 + 1.959963984540054**2))
        np.testing.assert_array_equal(probe.test_pred, y_te)


def test_evaluate_d1_fields_and_record():
    X_tr, y_tr, g_tr = paired_data(80, d=32, shift=1.0, seed=0)
    X_te, y_te, g_te = paired_data(40, d=32, shift=1.0, seed=1, prefix="t")
    result = evaluate_d1(X_tr, y_tr, g_tr, X_te, y_te, g_te, seed=3)
    assert list(result.probes) == ["logistic", "diffmean"]
    for name, probe in result.probes.items():
        counts = (probe.probe, probe.n_train, probe.n_test, probe.n_folds, probe.n_bootstrap)
        assert counts == (name, 160, 80, 5, 1000)
        assert probe.oof_scores.shape == (160,)
        assert probe.test_scores.shape == (80,)
        assert probe.test_auroc == auroc(probe.test_scores, y_te)
        assert probe.ci_low <= probe.test_auroc <= probe.ci_high
        assert probe.test_auroc > 0.6
        record = probe.to_record()
        assert set(record) == {"probe", "cv_auroc", "cv_fold_aurocs", "test_auroc", "ci_low", "ci_high",
                               "ci_level", "ci_method", "ci_degenerate", "n_train", "n_test", "n_folds",
                               "n_bootstrap"}
        assert json.loads(json.dumps(record)) == record
    again = evaluate_d1(X_tr, y_tr, g_tr, X_te, y_te, g_te, seed=3)
    assert again.to_records() == result.to_records()


# --- boundaries ------------------------------------------------------------------------------------------


def one_line_error(call) -> str:
    with pytest.raises(ProbeError) as info:
        call()
    assert isinstance(info.value, PoolBenchError)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_boundary_errors_are_one_line():
    X_tr, y_tr, g_tr = paired_data(10, d=4, shift=1.0, seed=0)
    X_te, y_te, g_te = paired_data(5, d=4, shift=1.0, seed=1, prefix="t")

    few = one_line_error(lambda: evaluate_d1(X_tr[:13], y_tr[:13], g_tr[:13], X_te, y_te, g_te))
    assert "10 pos and 3 neg" in few
    assert "5-fold" in few

    one_class = one_line_error(lambda: evaluate_d1(X_tr, np.ones(20, dtype=int), g_tr, X_te, y_te, g_te))
    assert "train split" in one_class
    assert "one class" in one_class

    one_class_test = one_line_error(lambda: evaluate_d1(X_tr, y_tr, g_tr, X_te, np.zeros(10, int), g_te))
    assert "test split" in one_class_test

    X_bad = X_te.copy()
    X_bad[2, 1] = np.nan
    X_bad[4, 0] = np.inf
    non_finite = one_line_error(lambda: evaluate_d1(X_tr, y_tr, g_tr, X_bad, y_te, g_te))
    assert "test split: 2 of 10 passages have NaN/inf" in non_finite

    width = one_line_error(lambda: evaluate_d1(X_tr, y_tr, g_tr, X_te[:, :3], y_te, g_te))
    assert "4 features" in width and "3" in width

    assert "unknown probe" in one_line_error(
        lambda: evaluate_d1(X_tr, y_tr, g_tr, X_te, y_te, g_te, probes=("svm",))
    )
    assert "one class" in one_line_error(lambda: auroc(np.arange(3.0), np.ones(3, dtype=int)))
