"""Per-cell reliability: Newton probe and fast folds = sklearn's; selectivity, online MDL, win rate, speed."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from sklearn.dummy import DummyClassifier
from sklearn.model_selection import StratifiedGroupKFold

from poolbench.prober.d1 import cv_auroc, cv_splits
from poolbench.prober.fast_folds import stratified_group_splits
from poolbench.prober.mdl import block_ends, online_codelength
from poolbench.prober.newton_logistic import NewtonLogisticProbe
from poolbench.prober.probes import make_logistic_probe
from poolbench.prober.reliability import across_cells, cell_reliability
from poolbench.prober.seed_spread import seed_spread
from poolbench.prober.selectivity import control_labels, selectivity, unit_hash
from poolbench.prober.win_rate import mean_win_rate


def paired_cell(n_pairs: int, d: int, shift: float, seed: int, prefix: str = "p"):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_pairs, d))
    X = np.r_[base + 0.3 * rng.normal(size=(n_pairs, d)), base + 0.3 * rng.normal(size=(n_pairs, d))]
    X[:n_pairs, 0] += shift
    y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
    groups = np.array([f"{prefix}{i}" for i in range(n_pairs)] * 2)
    ids = np.array([f"{prefix}{i}-{kind}" for kind in ("pos", "neg") for i in range(n_pairs)])
    return X, y, groups, ids


@pytest.mark.parametrize(("n", "d"), [(128, 256), (300, 16), (4, 64)])
def test_newton_probe_equals_sklearn_logistic(n, d):
    rng = np.random.default_rng(n)
    X = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + 3.0
    y = np.r_[np.ones(n // 2, dtype=int), np.zeros(n - n // 2, dtype=int)]
    X[:, 0] += y
    X[:, 1] = 7.0  # a constant feature, as P2_first gives on a causal LM
    ours = NewtonLogisticProbe().fit(X, y)
    ref = make_logistic_probe(0).set_params(logisticregression__tol=1e-10).fit(X, y)
    np.testing.assert_allclose(ours.coef_, ref[-1].coef_[0], atol=1e-5)
    np.testing.assert_allclose(ours.decision_function(X), ref.decision_function(X), atol=1e-4)


def test_fast_folds_equal_sklearn_stratified_group_kfold():
    rng = np.random.default_rng(1)
    for trial in range(25):
        n_pairs = int(rng.integers(5, 60))
        y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
        g = np.r_[np.arange(n_pairs), np.arange(n_pairs)].astype(str)
        if trial % 3 == 0:
            g, y = np.r_[g, [f"s{i}" for i in range(7)]], np.r_[y, rng.integers(0, 2, 7)]
        seed, k = int(rng.integers(0, 1000)), int(rng.integers(2, 6))
        ours = stratified_group_splits(y, g, k, seed)
        theirs = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros((y.size, 1)), y, g)
        for (a_fit, a_val), (b_fit, b_val) in zip(theirs, ours, strict=True):
            assert np.array_equal(a_fit, b_fit) and np.array_equal(a_val, b_val)
        assert all(np.array_equal(a[1], b[1]) for a, b in zip(cv_splits(y, g, k, seed), ours, strict=True))


def test_seed_spread_first_seed_is_d1_cv_auroc():
    X, y, g, _ = paired_cell(40, 12, 1.0, seed=3)
    spread = seed_spread(X, y, g, seed=7, n_seeds=5)
    assert spread.seeds == (7, 8, 9, 10, 11)
    assert spread.cv_aurocs[0] == pytest.approx(cv_auroc(X, y, g, "logistic", seed=7).auroc, abs=1e-9)
    assert spread.mean == pytest.approx(spread.cv_aurocs.mean())
    assert spread.std == pytest.approx(np.std(spread.cv_aurocs, ddof=1))


def test_control_labels_hand_computed():
    # Three pairs and two singletons; keys are each group's smallest id; balance: 4 true positives.
    ids = np.array(["a1", "a2", "b1", "b2", "c1", "c2", "d", "e"])
    groups = np.array(["A", "A", "B", "B", "C", "C", "d", "e"])
    y = np.array([1, 0, 1, 0, 1, 0, 1, 0])
    order = sorted(["a1", "b1", "c1", "d", "e"], key=lambda k: unit_hash(k, 5))
    sizes = {"a1": 2, "b1": 2, "c1": 2, "d": 1, "e": 1}
    expected, n_pos = {}, 0
    for key in order:  # greedy: label 1 while the count stays <= 4
        expected[key] = int(n_pos + sizes[key] <= 4)
        n_pos += sizes[key] * expected[key]
    labels = control_labels(ids, y, groups, seed=5)
    by_key = {"a1": labels[0], "b1": labels[2], "c1": labels[4], "d": labels[6], "e": labels[7]}
    assert by_key == expected
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[4] == labels[5]
    assert labels.sum() == 4
    # fixed by id, not by position: permuting the passages permutes the labels
    perm = np.array([7, 3, 5, 1, 0, 6, 2, 4])
    assert np.array_equal(control_labels(ids[perm], y[perm], groups[perm], seed=5), labels[perm])
    assert unit_hash("a1", 5) == unit_hash("a1", 5) != unit_hash("a1", 6)


def test_selectivity_is_true_minus_control():
    X, y, g, ids = paired_cell(40, 8, 3.0, seed=0)
    result = selectivity(X, y, g, ids, seed=0)
    assert result.true_score > 0.95
    assert abs(result.control_score - 0.5) < 0.25
    assert result.selectivity == pytest.approx(result.true_score - result.control_score)


def test_block_ends_hand_computed():
    assert block_ends([2] * 80) == [2, 4, 6, 10, 20, 40, 80, 160]
    assert block_ends([1] * 8, [0.25, 0.5, 1.0]) == [2, 4, 8]


def test_online_codelength_hand_computed_with_prior_probe():
    # Blocks [0,2) [2,4) [4,8). Block 1: uniform, 2 bits. Block 2: the prefix (1, 1) has one class, so the
    # uniform rule: 2 bits. Block 3: the prior probe on (1, 1, 0, 1) says p(1) = 3/4; labels 0, 0, 1, 0
    # cost 3 * log2(4) + log2(4/3) bits.
    y = np.array([1, 1, 0, 1, 0, 0, 1, 0])
    code = online_codelength(np.zeros((8, 1)), y, seed=0, shuffle=False, fractions=(0.25, 0.5, 1.0),
                             probe=lambda seed: DummyClassifier(strategy="prior"))
    expected = 2 + 2 + 6 + math.log2(4 / 3)
    assert code.block_ends == (2, 4, 8)
    assert code.block_bits == pytest.approx((2.0, 2.0, 6 + math.log2(4 / 3)))
    assert code.online_bits == pytest.approx(expected)
    assert code.uniform_bits == 8
    assert code.compression == pytest.approx(8 / expected)


def test_online_codelength_separable_compresses_random_does_not():
    X, y, g, _ = paired_cell(80, 16, 4.0, seed=1)
    assert online_codelength(X, y, g, seed=0).compression > 2.0
    rng = np.random.default_rng(0)
    noise = online_codelength(rng.normal(size=(160, 16)), y, g, seed=0)
    assert noise.compression < 1.1


def test_win_rate_hand_computed():
    # unit 1: A .9 > B .8 = C .8 ; unit 2: C .7 > A .6 > B .5 ; unit 3: B missing, A .5 = C .5
    scores = np.array([[0.9, 0.8, 0.8], [0.6, 0.5, 0.7], [0.5, np.nan, 0.5]])
    rates = mean_win_rate(scores, ["A", "B", "C"])
    assert rates["A"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert rates["B"] == pytest.approx((0.25 + 0.0) / 2)
    assert rates["C"] == pytest.approx((0.25 + 1.0 + 0.5) / 3)


def test_across_cells_on_records():
    rng = np.random.default_rng(0)
    records = [{"concept": c, "layer": L, "strategy": s, "probe": p, "test_auroc": base + rng.normal(0, 0.01)}
               for c in ("x", "y") for L in (0, 1, 2) for s, base in (("S1", 0.9), ("S2", 0.7), ("S3", 0.5))
               for p in ("logistic", "diffmean")]
    out = across_cells(records)
    assert out["n_units"] == 6
    assert out["win_rate"] == {"S1": 1.0, "S2": 0.5, "S3": 0.0}
    assert out["friedman"]["average_ranks"] == {"S1": 1.0, "S2": 2.0, "S3": 3.0}
    assert out["per_concept"]["x"]["n_units"] == 3


def test_cell_reliability_keys_and_speed():
    X, y, g, ids = paired_cell(80, 256, 0.8, seed=2)
    Xt, yt, gt, _ = paired_cell(40, 256, 0.8, seed=3, prefix="t")
    out = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0)
    assert set(out) >= {"seed_mean", "seed_std", "selectivity", "control_cv_auroc", "mdl_compression"}
    assert len(out["seed_cv_aurocs"]) == 5 and out["mdl_uniform_bits"] == 160
    times = []
    for seed in range(3):
        start = time.perf_counter()
        cell_reliability(X, y, g, ids, Xt, yt, gt, seed=seed)
        times.append(time.perf_counter() - start)
    assert min(times) < 0.5  # budget 0.25 s on an idle core; generous for a loaded CI box
