"""Per-cell reliability: Newton probe and fast folds = sklearn's; selectivity, online MDL, win rate, speed;
each statistic with a case where it should come out bad and does."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.special import expit
from sklearn.dummy import DummyClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from poolbench.prober.d1 import cv_auroc, cv_splits, evaluate_d1
from poolbench.prober.fast_folds import stratified_group_splits
from poolbench.prober.mdl import block_ends, online_codelength, platt_scaling
from poolbench.prober.newton_logistic import LOGISTIC_C, NewtonLogisticProbe
from poolbench.prober.power import clustered_mcnemar_pvalues, compare_configurations
from poolbench.prober.probes import make_logistic_probe
from poolbench.prober.reliability import across_cells, cell_reliability
from poolbench.prober.seed_spread import fold_auroc, seed_spread
from poolbench.prober.selectivity import control_labels, control_na_reason, selectivity, unit_hash
from poolbench.prober.significance import nemenyi_critical_difference
from poolbench.prober.win_rate import mean_win_rate
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard


def paired_cell(n_pairs: int, d: int, shift: float, seed: int, prefix: str = "p"):
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n_pairs, d))
    X = np.r_[base + 0.3 * rng.normal(size=(n_pairs, d)), base + 0.3 * rng.normal(size=(n_pairs, d))]
    X[:n_pairs, 0] += shift
    y = np.r_[np.ones(n_pairs, dtype=int), np.zeros(n_pairs, dtype=int)]
    groups = np.array([f"{prefix}{i}" for i in range(n_pairs)] * 2)
    ids = np.array([f"{prefix}{i}-{kind}" for kind in ("pos", "neg") for i in range(n_pairs)])
    return X, y, groups, ids


def sklearn_fold_auroc(X, y, splits) -> float:
    """The reference: scikit-learn's L2 logistic at LOGISTIC_C solved to 1e-10 on each fold, scored by
    scikit-learn's roc_auc_score, averaged over folds."""
    scores = []
    for fit_idx, val_idx in splits:
        model = make_pipeline(StandardScaler(), LogisticRegression(C=LOGISTIC_C, tol=1e-10, max_iter=10000))
        model.fit(X[fit_idx], y[fit_idx])
        scores.append(roc_auc_score(y[val_idx], model.decision_function(X[val_idx])))
    return float(np.mean(scores))


def sklearn_cv_auroc(X, y, groups, seed: int, k: int = 5) -> float:
    """D1's cv AUROC rebuilt from scikit-learn alone: StratifiedGroupKFold(shuffle, seed) keeps pairs together."""
    folds = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros((y.size, 1)), y, groups)
    return sklearn_fold_auroc(X, y, list(folds))


@pytest.mark.parametrize(("n", "d"), [(128, 256), (300, 16), (4, 64)])
def test_newton_probe_equals_sklearn_logistic(n, d):
    rng = np.random.default_rng(n)
    X = rng.normal(size=(n, d)) * rng.uniform(0.1, 5, size=d) + 3.0
    y = np.r_[np.ones(n // 2, dtype=int), np.zeros(n - n // 2, dtype=int)]
    X[:, 0] += y
    X[:, 1] = 7.0  # a constant feature, as P2_first gives on a causal LM
    ours = NewtonLogisticProbe().fit(X, y)
    ref = make_pipeline(StandardScaler(), LogisticRegression(C=LOGISTIC_C, tol=1e-10, max_iter=10000)).fit(X, y)
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


def test_fold_sets_are_remembered_by_labels_groups_folds_and_seed(monkeypatch):
    import poolbench.prober.fast_folds as fast_folds
    monkeypatch.setattr(fast_folds, "_remembered", type(fast_folds._remembered)())
    monkeypatch.setattr(fast_folds, "FOLD_CACHE", 3)
    computed = []
    assign = fast_folds._assign
    monkeypatch.setattr(fast_folds, "_assign", lambda *a: computed.append(a[2:]) or assign(*a))
    y = np.r_[np.ones(20, dtype=int), np.zeros(20, dtype=int)]
    g = np.r_[np.arange(20), np.arange(20)].astype(str)
    first = stratified_group_splits(y, g, 5, 0)
    again = stratified_group_splits(y.copy(), g.copy(), 5, 0)  # equal values, other arrays: remembered
    assert computed == [(5, 0)] and all(a[1] is b[1] for a, b in zip(first, again, strict=True))
    with pytest.raises(ValueError, match="read-only"):
        again[0][1][0] = 99  # no caller can change the folds another cell reads
    # each of labels, groups (also as objects), fold count and seed is part of the key: each is assigned anew
    swapped = g.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    sk = StratifiedGroupKFold(n_splits=5, shuffle=True, random_state=0).split(np.zeros((40, 1)), y, swapped)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(sk, stratified_group_splits(y, swapped, 5, 0), strict=True))
    stratified_group_splits(y, g.astype(object), 5, 0)
    stratified_group_splits(y, g, 4, 0)
    stratified_group_splits(y, g, 5, 1)
    assert computed == [(5, 0), (5, 0), (5, 0), (4, 0), (5, 1)]
    assert len(fast_folds._remembered) == 3  # the oldest left once the cache is full
    stratified_group_splits(y, g, 5, 0)
    assert computed[-1] == (5, 0) and len(computed) == 6


def test_seed_spread_first_seed_is_d1_cv_auroc():
    X, y, g, _ = paired_cell(40, 12, 1.0, seed=3)
    spread = seed_spread(X, y, g, seed=7, n_seeds=5)
    assert spread.seeds == (7, 8, 9, 10, 11)
    assert spread.cv_aurocs[0] == pytest.approx(cv_auroc(X, y, g, "logistic", seed=7).auroc, abs=1e-9)
    # Independently refitted: one scikit-learn cv AUROC per seed, then numpy's mean and sample std over seeds.
    refs = [sklearn_cv_auroc(X, y, g, seed=s) for s in (7, 8, 9, 10, 11)]
    np.testing.assert_allclose(spread.cv_aurocs, refs, atol=1e-6)
    assert spread.mean == pytest.approx(np.mean(refs), abs=1e-6)
    assert spread.std == pytest.approx(np.std(refs, ddof=1), abs=1e-6) and spread.std > 0


def test_seed_zero_reproduces_d1_exactly():
    # One probe: D1's logistic and every reliability statistic fit the same Newton estimator from scratch, so
    # the reliability's first seed is D1's cv_auroc to the last bit. On this cell lbfgs at tol 1e-4 stopped
    # short of the optimum (D1 once said 0.6109375); the reference is scikit-learn solved to tol 1e-10.
    X, y, g, ids = paired_cell(80, 64, 0.7, seed=0)
    Xt, yt, gt, _ = paired_cell(40, 64, 0.7, seed=100, prefix="t")
    d1 = evaluate_d1(X, y, g, Xt, yt, gt, seed=0, n_bootstrap=10, probes=("logistic",))["logistic"]
    types = np.array([f"domain{i % 4}" for i in range(80)] * 2)
    stats = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0, types_train=types)
    assert stats["seed_cv_aurocs"][0] == d1.cv_auroc == pytest.approx(sklearn_cv_auroc(X, y, g, seed=0), abs=1e-9)
    cv_ref = sklearn_cv_auroc(X, y, g, seed=0)
    assert stats["selectivity"] == pytest.approx(cv_ref - stats["control_cv_auroc"], abs=1e-9)
    untyped = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0)
    assert untyped["selectivity"] is None and "no lexical type" in untyped["selectivity_na_reason"]
    spread = seed_spread(X, y, g, seed=0, n_seeds=2)
    assert spread.cv_aurocs[0] == cv_auroc(X, y, g, "logistic", seed=0).auroc == d1.cv_auroc


def typed_cell(n_pairs: int, d: int, shift: float, content: float, seed: int, n_types: int = 4):
    """Matched pairs spread over `n_types` lexical types (domains); the positive is shifted by `shift` on feature 0
    (the concept) and every passage of type t carries `content` on feature 1 + t (its domain's vocabulary)."""
    X, y, g, ids = paired_cell(n_pairs, d, shift, seed)
    types = np.array([f"domain{i % n_types}" for i in range(n_pairs)] * 2)
    for t in range(n_types):
        X[types == f"domain{t}", 1 + t] += content
    return X, y, g, ids, types


def test_control_labels_hand_computed():
    # Types of 4, 2, 2 passages; in unit_hash order each is labelled 1 while the positives stay <= 8 / 2
    # (the first type always): one label per type, never per passage.
    types = np.array(["a"] * 4 + ["b"] * 2 + ["c"] * 2)
    sizes = {"a": 4, "b": 2, "c": 2}
    expected, n_pos = {}, 0
    for key in sorted(sizes, key=lambda k: unit_hash(k, 5)):
        expected[key] = int(n_pos == 0 or n_pos + sizes[key] <= 4)
        n_pos += sizes[key] * expected[key]
    labels = control_labels(types, seed=5)
    assert {t: int(labels[types == t][0]) for t in sizes} == expected
    assert all(np.unique(labels[types == t]).size == 1 for t in sizes)
    perm = np.array([7, 3, 5, 1, 0, 6, 2, 4])
    assert np.array_equal(control_labels(types[perm], seed=5), labels[perm])
    assert unit_hash("a1", 5) == unit_hash("a1", 5) != unit_hash("a1", 6)


def test_selectivity_is_high_for_a_concept_without_content():
    """The concept is planted and the domains leave no trace in X: the control cannot be learnt and S is high."""
    X, y, g, _, types = typed_cell(80, 8, 3.0, 0.0, seed=0)
    result = selectivity(X, y, g, types, seed=0)
    assert result.true_score > 0.95 and abs(result.control_score - 0.5) < 0.15 and result.selectivity > 0.3
    assert result.selectivity == pytest.approx(result.true_score - result.control_score)
    control = control_labels(types, 0)
    assert result.control_score == pytest.approx(
        fold_auroc(X, control, stratified_group_splits(control, g, 5, 0), make_logistic_probe, 0))


def test_selectivity_is_low_for_a_representation_that_carries_content():
    """The should-fail case: a weak concept and strong domain vocabulary: the probe learns type -> control label
    from other pairs of the same type, the control nears 1 and S falls below 0."""
    X, y, g, _, types = typed_cell(80, 8, 0.5, 4.0, seed=0)
    result = selectivity(X, y, g, types, seed=0)
    assert result.control_score > 0.95 and result.control_ci_low > 0.5
    assert result.selectivity < 0.0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_control_on_an_uninformative_representation_is_near_half_and_its_interval_covers_it(seed):
    X, y, g, _, types = typed_cell(80, 16, 0.0, 0.0, seed=seed)
    result = selectivity(X, y, g, types, seed=seed)
    assert abs(result.control_score - 0.5) < 0.15
    assert result.control_ci_low <= 0.5 <= result.control_ci_high


def test_twins_cannot_carry_the_control():
    """v2's failure: near-identical twins in 256 dimensions let a probe read a pair's control label off the twin in
    another fold (control 0.9+). Folds now keep pairs together, so on content-free types the control stays near 0.5."""
    X, y, g, _, types = typed_cell(80, 256, 0.0, 0.0, seed=0)
    assert abs(selectivity(X, y, g, types, seed=0).control_score - 0.5) < 0.15


def test_selectivity_is_na_without_recurring_types():
    X, y, g, _, _ = typed_cell(40, 8, 3.0, 0.0, seed=0)
    result = selectivity(X, y, g, None, seed=0)
    assert result.selectivity is None and result.control_score is None and "no lexical type" in result.na_reason
    one_type = selectivity(X, y, g, np.array(["news"] * 80), seed=0)
    assert one_type.selectivity is None and "1 lexical type(s) recur" in one_type.na_reason
    assert "0 lexical type(s) recur" in control_na_reason(g, g, 5, 0)  # each pair its own type: nothing recurs


def test_block_ends_hand_computed():
    assert block_ends([2] * 80) == [2, 4, 6, 10, 20, 40, 80, 160]
    assert block_ends([1] * 8, [0.25, 0.5, 1.0]) == [2, 4, 8]
    # a floor of 16: ceil(f * 160) below 16 all snap to 16; 0.125 * 160 = 20 stays
    assert block_ends([2] * 80, min_block=16) == [16, 20, 40, 80, 160]
    assert block_ends([3, 3, 3, 3], [0.1, 1.0], min_block=5) == [6, 12]


def test_online_codelength_hand_computed_with_prior_probe():
    # Blocks [0,2) [2,4) [4,8). Block 1: uniform, 2 bits. Block 2: the prefix (1, 1) has one class, so the
    # uniform rule: 2 bits. Block 3: the prior probe on (1, 1, 0, 1) says p(1) = 3/4; labels 0, 0, 1, 0
    # cost 3 * log2(4) + log2(4/3) bits.
    y = np.array([1, 1, 0, 1, 0, 0, 1, 0])
    code = online_codelength(np.zeros((8, 1)), y, seed=0, shuffle=False, fractions=(0.25, 0.5, 1.0),
                             probe=lambda seed: DummyClassifier(strategy="prior"), min_block=0,
                             calibration_folds=0, min_blocks=3)
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


def test_platt_scaling_hand_computed_and_recovers_calibrated_logits():
    # Constant logits carry nothing: slope 0, and sigmoid(b) = the mean smoothed target. 3 pos, 1 neg:
    # targets 4/5 and 1/3, mean (3 * 4/5 + 1/3) / 4 = 41/60, so b = log(41/19).
    a, b = platt_scaling(np.zeros(4), np.array([1, 1, 1, 0]))
    assert a == pytest.approx(0.0, abs=1e-9)
    assert b == pytest.approx(math.log(41 / 19), abs=1e-6)
    # Logits that are already calibrated come back with slope 1 and intercept 0.
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 2.0, 20000)
    a, b = platt_scaling(z, (rng.random(z.size) < expit(z)).astype(int))
    assert a == pytest.approx(1.0, abs=0.05) and b == pytest.approx(0.0, abs=0.05)


def test_mdl_has_at_least_five_blocks_or_none():
    """16 pairs: the floor of 16 passages leaves blocks ending 16, 32 (one coded block), so five near-equal blocks
    on pair boundaries replace them; 4 pairs cannot make five blocks, so no compression and the reason."""
    rng = np.random.default_rng(0)
    y, g = np.tile([1, 0], 16), np.repeat(np.arange(16), 2)
    code = online_codelength(rng.normal(size=(32, 4)), y, g, seed=0)
    assert code.block_ends == (8, 14, 20, 26, 32)  # ceil(k * 32 / 5) = 7, 13, 20, 26, 32 -> next even boundary
    assert len(code.block_bits) == 5 and code.compression is not None
    small = online_codelength(rng.normal(size=(8, 4)), y[:8], g[:8], seed=0)
    assert small.compression is None and "4 pair groups give 4 blocks" in small.na_reason


def test_mdl_compression_rises_with_signal_and_is_one_without():
    # 160 passages, 256 dimensions (more features than passages, as in every embedded cell). Compression must
    # rise with the planted signal, sit at 1 (nothing to compress) without one, exceed 1 wherever the probe
    # decodes the concept, and no block may cost much more than the uniform code's 1 bit a label.
    codes, decoded = [], []
    for shift in (0.0, 1.0, 2.0, 3.0, 4.0):
        X, y, g, _ = paired_cell(80, 256, shift, seed=1)
        codes.append(online_codelength(X, y, g, seed=0))
        decoded.append(cv_auroc(X, y, g).auroc > 0.65)
    compressions = [code.compression for code in codes]
    assert compressions[0] == pytest.approx(1.0, abs=0.01)
    assert all(a < b for a, b in itertools.pairwise(compressions))
    assert all(c > 1.03 for c, d in zip(compressions, decoded, strict=True) if d) and sum(decoded) >= 4
    assert compressions[-1] > 1.5
    for code in codes:
        per_label = np.array(code.block_bits) / np.diff(np.r_[0, code.block_ends])
        assert code.block_ends[0] == 16 and per_label[0] == 1.0
        assert per_label.max() < 1.05


def test_win_rate_hand_computed():
    # unit 1: A .9 > B .8 = C .8 ; unit 2: C .7 > A .6 > B .5 ; unit 3: B missing, A .5 = C .5
    scores = np.array([[0.9, 0.8, 0.8], [0.6, 0.5, 0.7], [0.5, np.nan, 0.5]])
    rates = mean_win_rate(scores, ["A", "B", "C"])
    assert rates["A"] == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert rates["B"] == pytest.approx((0.25 + 0.0) / 2)
    assert rates["C"] == pytest.approx((0.25 + 1.0 + 0.5) / 3)


def test_across_cells_on_records():
    rng = np.random.default_rng(0)
    records = [{"concept": c, "layer": L, "strategy": s, "probe": p, "test_auroc": base + rng.normal(0, 0.01),
                "cv_auroc": base - 0.01 * L}
               for c in ("x", "y") for L in (0, 1, 2) for s, base in (("S1", 0.9), ("S2", 0.7), ("S3", 0.5))
               for p in ("logistic", "diffmean")]
    out = across_cells(records)
    assert out["n_units"] == 2  # concepts are the blocks; each strategy at its CV-chosen layer (0 here)
    assert out["unit"] == "concept" and out["layers"] == {"S1": 0, "S2": 0, "S3": 0}
    assert out["win_rate"] == {"S1": 1.0, "S2": 0.5, "S3": 0.0}
    assert out["friedman"]["average_ranks"] == {"S1": 1.0, "S2": 2.0, "S3": 3.0}
    assert out["per_concept"]["x"]["n_units"] == 3


def _grid_records(n_concepts: int, layers: tuple[int, ...], n_strategies: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"concept": f"c{c:02d}", "layer": L, "strategy": f"S{s:02d}", "probe": "logistic",
             "test_auroc": float(rng.uniform(0.5, 1.0)), "cv_auroc": float(rng.uniform(0.5, 1.0)),
             "ci_low": 0.4, "ci_high": 1.0}
            for c in range(n_concepts) for L in layers for s in range(n_strategies)]


def test_friedman_blocks_are_concepts_not_concept_layer_cells():
    # The shape: 17 concepts x 4 layers x 19 strategies. The layers of a concept share passages, so
    # the blocks are the 17 concepts: CD = q(19) sqrt(19 * 20 / (6 * 17)) = 6.79, not 3.39 from 68 cells.
    records = _grid_records(17, (0, 1, 2, 3), 19, seed=5)
    out = across_cells(records)
    friedman = out["friedman"]
    assert out["n_units"] == friedman["n_units"] == 17
    assert friedman["critical_difference"] == pytest.approx(nemenyi_critical_difference(19, 17)[1])
    assert friedman["critical_difference"] == pytest.approx(6.79, abs=0.005)
    # each strategy is judged at the leaderboard's layer, and the output says which
    board = build_leaderboard([D1CellRecord.from_dict(r) for r in records])
    assert out["layers"] == {row["strategy"]: row["best_layer"] for row in board["strategies"]}
    assert "CV-chosen layer" in out["layer_selection"]


def test_friedman_judges_each_strategy_at_its_cv_chosen_layer():
    # A is best on test at layer 1 but its CV picks layer 0, where it is worst: its rank is judged there.
    records = []
    for c, noise in (("x", 0.0), ("y", 0.01), ("z", 0.02)):
        for L, a_test, a_cv in ((0, 0.60, 0.9), (1, 0.99, 0.8)):
            records.append({"concept": c, "layer": L, "strategy": "A", "test_auroc": a_test + noise,
                            "cv_auroc": a_cv})
            records.append({"concept": c, "layer": L, "strategy": "B", "test_auroc": 0.80 + noise,
                            "cv_auroc": 0.7 + 0.1 * L})
            records.append({"concept": c, "layer": L, "strategy": "C", "test_auroc": 0.70 + noise,
                            "cv_auroc": 0.8 - 0.1 * L})
    out = across_cells(records)
    assert out["friedman"]["average_ranks"] == {"A": 3.0, "B": 1.0, "C": 2.0}
    assert out["win_rate"] == {"A": 0.0, "B": 1.0, "C": 0.5}
    assert out["layers"] == {"A": 0, "B": 1, "C": 0}
    given = across_cells(records, layers={"A": 1, "B": 1, "C": 1})
    assert given["friedman"]["average_ranks"]["A"] == 1.0 and given["layers"]["A"] == 1


def _exact_pair_power(p_pairs: tuple[float, float, float], n_pairs: int, alpha: float = 0.05) -> float:
    """Power when whole pairs are drawn: k pairs with A right on both and B wrong (d = +2), j the reverse (d = -2),
    tested at the pair level: X^2 = (2k - 2j)^2 / (4k + 4j) = (k - j)^2 / (k + j), half the passage-level
    McNemar's (2k - 2j)^2 / (2k + 2j)."""
    from scipy.stats import multinomial

    power = 0.0
    for k in range(n_pairs + 1):
        for j in range(n_pairs + 1 - k):
            if clustered_mcnemar_pvalues(np.array(2.0 * (k - j)), np.array(4.0 * (k + j))) < alpha:
                power += multinomial.pmf([k, j, n_pairs - k - j], n_pairs, p_pairs)
    return power


def test_mcnemar_power_resamples_pairs():
    # 20 test pairs; twins always agree: 6 pairs only A right (on both twins), 2 only B, 12 both right.
    # Drawing pairs, a test set of 20 passages holds 10 pairs whose discordant counts come in twos; tested as
    # pairs, exact power 0.158 at n = 20 and 0.270 at n = 40 (a passage-level McNemar on the same draws counts each
    # pair's evidence twice and says 0.306 and 0.468).
    y = np.tile([1, 0], 20)
    groups = np.repeat(np.arange(20), 2)
    kind = np.repeat(np.r_[np.full(6, 1), np.full(2, 2), np.zeros(12, dtype=int)], 2)
    pred_a = np.where(kind == 2, 1 - y, y)
    pred_b = np.where(kind == 1, 1 - y, y)
    scores_a, scores_b = pred_a + 0.1 * (groups % 3), pred_b + 0.1 * (groups % 5)
    out = compare_configurations(pred_a, pred_b, scores_a, scores_b, y, groups, d=4, sizes=(20, 40),
                                 n_resamples=20000, n_bootstrap=10)
    for row, n_pairs in zip(out["power"], (10, 20), strict=True):
        assert row["power"] == pytest.approx(_exact_pair_power((0.3, 0.1, 0.6), n_pairs), abs=0.012)
    assert out["power"][0]["power"] == pytest.approx(0.158, abs=0.012)


def test_cell_reliability_keys_and_its_cost_in_probe_fits(monkeypatch):
    """Its cost is a fixed number of probe fits, none on more than the train split (timing lives in bench/):
    seeds 5 x folds 5 = 25, MDL's 4 coded blocks (ends 16, 20, 40, 80, 160 after the uniform first block) x 3
    calibration folds = 12, and the control task's 5 folds only where lexical types are given (else n/a): 37 / 42."""
    X, y, g, ids = paired_cell(80, 256, 0.8, seed=2)
    Xt, yt, gt, _ = paired_cell(40, 256, 0.8, seed=3, prefix="t")
    fits: list[tuple[int, int]] = []
    real_fit = NewtonLogisticProbe.fit

    def counted_fit(self, X_fit, y_fit):
        fits.append(X_fit.shape)
        return real_fit(self, X_fit, y_fit)

    monkeypatch.setattr(NewtonLogisticProbe, "fit", counted_fit)
    out = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0)
    assert set(out) >= {"seed_mean", "seed_std", "selectivity", "control_cv_auroc", "mdl_compression"}
    assert len(out["seed_cv_aurocs"]) == 5 and out["mdl_uniform_bits"] == 160
    assert out["mdl_block_ends"] == [16, 20, 40, 80, 160]
    assert sum(out["mdl_block_bits"]) == pytest.approx(out["mdl_online_bits"])
    assert len(fits) == 25 + 4 * 3 and out["selectivity"] is None
    assert all(rows <= 160 and cols == 256 for rows, cols in fits)  # never the test split, never stacked
    fits.clear()
    types = np.array([f"domain{i % 4}" for i in range(80)] * 2)
    typed = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0, types_train=types)
    assert typed["selectivity"] is not None and len(fits) == 25 + 5 + 4 * 3
    # D1's cv_auroc of the cell (the same five fits at this seed) stands in for the first seed: 5 fits fewer, the
    # same statistics to the last bit; a wrong value would show in the seed list and in selectivity
    fits.clear()
    d1 = evaluate_d1(X, y, g, Xt, yt, gt, seed=0, n_bootstrap=10, probes=("logistic",))["logistic"]
    fits.clear()
    reused = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0, types_train=types, d1_cv_auroc=d1.cv_auroc)
    assert len(fits) == 20 + 5 + 4 * 3 and reused == typed
    wrong = cell_reliability(X, y, g, ids, Xt, yt, gt, seed=0, types_train=types, d1_cv_auroc=d1.cv_auroc - 0.1)
    assert wrong["seed_cv_aurocs"][0] != typed["seed_cv_aurocs"][0] and wrong["selectivity"] != typed["selectivity"]
