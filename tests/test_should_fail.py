"""Statistics that must come out bad where they should: seed sigma on an unstable probe (and equal to numpy's std of
independently refitted probes), Friedman/Nemenyi's type-I error on null data and power on a planted difference."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.random_projection import GaussianRandomProjection

from poolbench.prober.newton_logistic import LOGISTIC_C
from poolbench.prober.seed_spread import seed_spread
from poolbench.prober.significance import friedman_nemenyi


def paired(n_pairs: int, d: int, shift: float, seed: int):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_pairs, d))
    X = np.r_[base + 0.5 * rng.normal(size=(n_pairs, d)), base + 0.5 * rng.normal(size=(n_pairs, d))]
    X[:n_pairs, 0] += shift
    y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
    return X, y, np.r_[np.arange(n_pairs), np.arange(n_pairs)]


def test_seed_sigma_equals_numpy_std_of_independently_refitted_probes():
    """Per seed: scikit-learn's StratifiedGroupKFold(shuffle, seed) folds, a fresh scikit-learn logistic per fold,
    roc_auc_score, the mean over folds; then numpy.std(ddof=1) over seeds. PoolBench's seed sigma must equal it."""
    X, y, g = paired(40, 6, 0.6, seed=1)
    spread = seed_spread(X, y, g, seed=3, n_seeds=5)
    means = []
    for s in range(3, 8):
        folds = StratifiedGroupKFold(n_splits=5, shuffle=True, random_state=s).split(X, y, g)
        aucs = []
        for fit, val in folds:
            model = make_pipeline(StandardScaler(), LogisticRegression(C=LOGISTIC_C, tol=1e-10, max_iter=10_000))
            aucs.append(roc_auc_score(y[val], model.fit(X[fit], y[fit]).decision_function(X[val])))
        means.append(np.mean(aucs))
    np.testing.assert_allclose(spread.cv_aurocs, means, atol=1e-6)
    assert spread.std == pytest.approx(np.std(means, ddof=1), abs=1e-6)


def test_seed_sigma_is_large_for_a_deliberately_unstable_probe():
    """The should-fail case: a probe that sees one random projection of 8 features (the concept on one of them)
    catches a different share of the signal per seed (AUROC 0.43 to 0.90), so its sigma is many times a convex
    probe's (0.002 here)."""
    X, y, g = paired(60, 8, 3.0, seed=0)

    def unstable(seed: int):
        return make_pipeline(GaussianRandomProjection(n_components=1, random_state=seed),
                             LogisticRegression(max_iter=1000))

    stable = seed_spread(X, y, g, seed=0, n_seeds=5)
    shaky = seed_spread(X, y, g, seed=0, n_seeds=5, probe=unstable)
    assert stable.std < 0.01
    assert shaky.std > 0.1 and shaky.std > 10 * stable.std


def _rejections(n_tables: int, n: int, k: int, shift: float, seed: int) -> tuple[float, float, float]:
    """(Friedman rejection rate, share of tables where Nemenyi separates any pair, share where it separates the
    planted strategy 0 from the worst) over null or planted [n concepts, k strategies] score tables."""
    rng = np.random.default_rng(seed)
    names = [f"S{i}" for i in range(k)]
    friedman = any_pair = planted = 0
    for _ in range(n_tables):
        scores = rng.normal(size=(n, k))
        scores[:, 0] += shift
        out = friedman_nemenyi(scores, names)
        ranks = np.array([out["average_ranks"][s] for s in names])
        friedman += out["p_value"] < 0.05
        any_pair += ranks.max() - ranks.min() > out["critical_difference"]
        planted += ranks.max() - ranks[0] > out["critical_difference"]
    return friedman / n_tables, any_pair / n_tables, planted / n_tables


def test_friedman_and_nemenyi_keep_type_one_error_on_null_data():
    """17 concepts x 5 strategies of i.i.d. scores: Friedman rejects at most ~5% (2 sigma of 600 tables: 0.068), and
    Nemenyi, a family-wise test, separates some pair no more often."""
    friedman, any_pair, _ = _rejections(600, 17, 5, 0.0, seed=0)
    assert friedman <= 0.068
    assert any_pair <= 0.068


def test_friedman_and_nemenyi_find_a_planted_difference():
    """One strategy 1.5 standard deviations above the rest on every concept: Friedman rejects and Nemenyi separates
    it from the worst in nearly every table (0.98, 0.97); at 0.1 sd they mostly cannot (power grows with the effect)."""
    friedman, _, planted = _rejections(300, 17, 5, 1.5, seed=1)
    assert friedman >= 0.9 and planted >= 0.9
    weak_friedman, _, _ = _rejections(300, 17, 5, 0.1, seed=2)
    assert weak_friedman < 0.2
