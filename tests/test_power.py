"""McNemar against statsmodels, simulated power against the exact binomial power, the data-size bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import multinomial
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from statsmodels.stats.contingency_tables import mcnemar

from poolbench.prober.newton_logistic import LOGISTIC_C
from poolbench.prober.power import (
    clustered_mcnemar_pvalues,
    compare_configurations,
    exact_mcnemar_power,
    is_collapsed,
    mcnemar_pvalues,
    mcnemar_test,
    recommended_size,
    recommended_train_size,
    simulate_power,
)


def test_mcnemar_table_and_p_match_statsmodels():
    y = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 0])
    a = np.array([1, 1, 1, 0, 0, 0, 1, 0, 1, 0])  # right on 8
    b = np.array([1, 0, 0, 0, 0, 1, 1, 1, 1, 0])  # right on 5
    out = mcnemar_test(a, b, y)
    # both right: idx 0,4,8,9 = 4; only A: 1,2,5,7 = 4; only B: 3? no (both wrong), 6? both wrong -> 0
    assert out.table.tolist() == [[4, 4], [0, 2]]
    assert out.p_value == pytest.approx(mcnemar([[4, 4], [0, 2]], exact=True).pvalue)
    assert out.p_value == pytest.approx(2 * 0.5**4)


@pytest.mark.parametrize(("b", "c"), [(0, 0), (3, 9), (10, 10), (40, 22), (1, 30)])
def test_vectorised_mcnemar_equals_statsmodels(b, c):
    assert mcnemar_pvalues(np.array([b]), np.array([c]))[0] == pytest.approx(
        mcnemar([[5, b], [c, 5]], exact=True).pvalue)


def enumerated_power(acc_a: float, acc_b: float, n: int, alpha: float = 0.05) -> float:
    """The reference: every 2x2 table of n independent (A, B) outcomes, weighted by scipy's multinomial pmf,
    rejected where statsmodels' exact McNemar gives p < alpha."""
    p_only_a, p_only_b = acc_a * (1 - acc_b), (1 - acc_a) * acc_b
    power = 0.0
    for b in range(n + 1):
        for c in range(n + 1 - b):
            if mcnemar([[0, b], [c, n - b - c]], exact=True).pvalue < alpha:
                power += multinomial.pmf([b, c, n - b - c], n, [p_only_a, p_only_b, 1 - p_only_a - p_only_b])
    return power


@pytest.mark.parametrize(("acc_a", "acc_b", "n"), [(0.80, 0.70, 50), (0.95, 0.60, 12), (0.70, 0.80, 30)])
def test_exact_power_equals_a_statsmodels_enumeration(acc_a, acc_b, n):
    assert exact_mcnemar_power(acc_a, acc_b, n) == pytest.approx(enumerated_power(acc_a, acc_b, n), abs=1e-9)


def test_exact_power_without_a_gap_is_at_most_alpha():
    """No difference to find: the 'power' is the test's size, which the exact (conservative) test keeps <= alpha."""
    for n in (10, 40, 120):
        assert 0 < exact_mcnemar_power(0.75, 0.75, n) <= 0.05


def test_simulated_power_recovers_planted_gap():
    # A right w.p. 0.80, B w.p. 0.70, independently: the power at n is the enumerated binomial sum.
    rng = np.random.default_rng(0)
    n_pool = 20000
    correct_a = rng.random((2, n_pool)) < 0.80
    correct_b = rng.random((2, n_pool)) < 0.70
    rows = simulate_power(correct_a, correct_b, sizes=(50, 150, 300), n_resamples=2000, seed=1, clustered=False)
    # Monte Carlo: 2000 resamples give a standard error of at most sqrt(0.25 / 2000) = 0.011; 0.04 is 3.6 of them.
    assert rows[0][1] == pytest.approx(enumerated_power(0.80, 0.70, 50), abs=0.04)
    for n, power in rows[1:]:  # exact_mcnemar_power equals the enumeration above; enumerating n=300 takes long
        assert power == pytest.approx(exact_mcnemar_power(0.80, 0.70, n), abs=0.04)
    assert rows[0][1] < rows[1][1] < rows[2][1]


def _null_pool(n_pairs: int = 1000, seed: int = 0):
    """Twin-correlated correctness with exactly equal accuracy: per pair a latent z = +-1 favours A or B
    (0.95 vs 0.55) for both twins; every pair also appears mirrored (A and B swapped)."""
    rng = np.random.default_rng(seed)
    z = rng.choice([-1, 1], n_pairs)
    pa, pb = np.repeat(0.75 + 0.2 * z, 2), np.repeat(0.75 - 0.2 * z, 2)
    ca, cb = rng.random(2 * n_pairs) < pa, rng.random(2 * n_pairs) < pb
    return np.r_[ca, cb], np.r_[cb, ca], np.repeat(np.arange(2 * n_pairs), 2)


def test_pair_level_power_keeps_type_one_error_on_null_data():
    ca, cb, groups = _null_pool()
    rows = simulate_power(ca, cb, (16, 50, 200, 800), groups=groups, n_resamples=4000, seed=1)
    assert max(p for _, p in rows) <= 0.06, rows


def test_passage_level_mcnemar_on_pairs_rejects_a_true_null_too_often():
    """The should-fail case: the same null, tested passage by passage, rejects well above 5% at n = 800."""
    ca, cb, groups = _null_pool()
    rows = dict(simulate_power(ca, cb, (800,), groups=groups, n_resamples=4000, seed=1, clustered=False))
    assert rows[800] > 0.075


def test_clustered_mcnemar_with_singletons_is_mcnemars_chi_square():
    # b = 7 only-A, c = 2 only-B passages as singleton clusters: (7 - 2)^2 / 9 on 1 df
    from scipy.stats import chi2

    assert clustered_mcnemar_pvalues(np.array(5.0), np.array(9.0)) == pytest.approx(chi2.sf(25 / 9, 1))
    assert clustered_mcnemar_pvalues(np.array(0.0), np.array(0.0)) == 1.0


def test_recommended_size_can_say_more_than_the_largest_size_tried():
    assert recommended_size([(50, 0.3), (100, 0.81), (200, 0.95)]) == {"n": 100, "more_than": None,
                                                                       "target_power": 0.8}
    assert recommended_size([(50, 0.1), (3200, 0.6)]) == {"n": None, "more_than": 3200, "target_power": 0.8}
    ca, cb, groups = _null_pool(200)  # no difference: no size reaches 80% power
    rows = simulate_power(ca, cb, (25, 3200), groups=groups, n_resamples=500, seed=2)
    assert recommended_size(rows)["more_than"] == 3200


def test_recommended_train_size_hand_computed():
    # d = 1: ln|H| = 64 ln 2; eps = 0.1; n = (64 ln 2 + ln 40) / 0.02 = 2402.48 -> 2403
    assert recommended_train_size(0.9, 0.7, d=1) == 2403
    assert recommended_train_size(0.7, 0.9, d=1) == 2403
    assert recommended_train_size(0.8, 0.8, d=256) is None
    n = recommended_train_size(0.85, 0.80, d=256)
    assert math.sqrt((32 * 257 * math.log(2) + math.log(40)) / (2 * n)) <= 0.025


def test_collapsed_definition():
    assert is_collapsed(0.3, -0.02, 0.05)
    assert not is_collapsed(0.01, -0.02, 0.05)
    assert not is_collapsed(0.3, 0.01, 0.05)


def test_compare_configurations_report():
    rng = np.random.default_rng(3)
    y = np.r_[np.ones(40, dtype=int), np.zeros(40, dtype=int)]
    groups = np.r_[np.arange(40), np.arange(40)]
    sa, sb = y * 2.0 + rng.normal(size=80), y * 0.2 + rng.normal(size=80)
    out = compare_configurations((sa > 1).astype(int), (sb > 0.1).astype(int), sa, sb, y, groups, d=8,
                                 sizes=(20, 80), n_resamples=200, n_bootstrap=200)
    assert out["auroc_difference"] > 0.3 and not out["collapsed"]
    assert [r["n"] for r in out["power"]] == [20, 80]
    assert out["pac_bound_train_size"] > 0
    assert out["recommended_test_size"]["n"] in (20, 80)


def test_power_command_table_json_and_errors(tmp_path):
    import json

    from reliability_run import cli, make_run
    from typer.testing import CliRunner

    from poolbench.errors import PoolBenchError

    run = make_run(tmp_path)
    runner = CliRunner()
    result = runner.invoke(cli(), ["power", "--strategies", "A1", "--strategies", "A2_max",
                                   "--concept", "negation", "--layer", "1", "--run", str(run),
                                   "--n-bootstrap", "200"])
    assert result.exit_code == 0, result.output
    assert "power" in result.output
    report = json.loads((run / "power_negation_A1_mean_vs_A2_max.json").read_text())
    assert report["layer_a"] == 1 and report["auroc_difference"] > 0.3 and not report["collapsed"]
    assert report["power"][-1]["power"] == 1.0
    # default layers: the leaderboard's (highest mean cv_auroc: layer 1)
    result = runner.invoke(cli(), ["power", "--strategies", "A1_mean,P1_last", "--concept", "sarcasm",
                                   "--run", str(run), "--n-bootstrap", "100",
                                   "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "p" / "power_sarcasm_A1_mean_vs_P1_last.json").read_text())["layer_b"] == 1
    for args, message in ((["--strategies", "A1,A1_mean", "--concept", "negation"], "with itself"),
                          (["--strategies", "A1,Z9", "--concept", "negation"], "'Z9' was not run"),
                          (["--strategies", "A1,P1", "--concept", "irony"], "'irony' was not run"),
                          (["--strategies", "A1", "--concept", "negation"], "exactly two")):
        result = runner.invoke(cli(), ["power", *args, "--run", str(run)])
        assert isinstance(result.exception, PoolBenchError), result.output
        assert message in str(result.exception) and "\n" not in str(result.exception)


def test_power_and_flash_check_score_s3_with_d1s_fold_wise_heads(tmp_path):
    """S3's all-heads row carries head 0's signal (held-out AUROC 0.976), but D1 picks its head on the
    training passages' head outputs, which point to head 1, whose pooled vector is noise (0.576). Power and
    flash-check must judge S3 as D1 does: the shortcut would rank S3 above A1_mean (0.856), D1 below."""
    import json

    from reliability_run import cli, make_s3_run, s3_concept
    from typer.testing import CliRunner

    from poolbench.prober.auroc import auroc
    from poolbench.prober.concept_probe import probe_pooled_table
    from poolbench.prober.flash import parse_fraction
    from poolbench.prober.flash_check import flash_scores
    from poolbench.prober.newton_logistic import NewtonLogisticProbe
    from poolbench.prober.power import ConceptCells

    pooled, heads = s3_concept("negation")
    d1 = {(r.strategy, r.probe): r for r in probe_pooled_table(pooled, "negation", n_bootstrap=20,
                                                                reliability=False, heads=heads)}
    s3, a1 = d1["S3_iti_probe", "logistic"], d1["A1_mean", "logistic"]
    assert s3.heads_selected == [1]
    # A1: D1's logistic refitted by scikit-learn on the same pooled train rows, scored on the test rows.
    a1_cells = ConceptCells(pooled).matrix(0, "A1_mean")
    a1_train, a1_test = a1_cells.subset("train"), a1_cells.subset("test")
    ref = make_pipeline(StandardScaler(), LogisticRegression(C=LOGISTIC_C, tol=1e-10, max_iter=10000))
    ref.fit(a1_train.X, a1_train.y)
    assert a1.test_auroc == pytest.approx(roc_auc_score(a1_test.y, ref.decision_function(a1_test.X)), abs=1e-6)
    # From the construction: A1's one signal coordinate is +-1 in unit noise (d' = 2, AUROC Phi(2 / sqrt 2) =
    # 0.92 at best); S3's selected head 1 pools pure noise, so its AUROC is 0.5 give or take sampling error
    # (30 + 30 test passages: SE about 0.075).
    assert 0.75 < a1.test_auroc <= 0.99 and abs(s3.test_auroc - 0.5) < 0.2
    shortcut = ConceptCells(pooled).matrix(0, "S3_iti_probe")
    train, test = shortcut.subset("train"), shortcut.subset("test")
    assert auroc(NewtonLogisticProbe().fit(train.X, train.y).decision_function(test.X), test.y) > 0.97

    run = make_s3_run(tmp_path)
    result = CliRunner().invoke(cli(), ["power", "--strategies", "S3,A1", "--concept", "negation", "--run",
                                        str(run), "--n-bootstrap", "100"])
    assert result.exit_code == 0, result.output
    report = json.loads((run / "power_negation_S3_iti_probe_vs_A1_mean.json").read_text())
    assert report["auroc_a"] == s3.test_auroc and report["auroc_b"] == a1.test_auroc
    assert report["auroc_difference"] < -0.2

    half = {(r.strategy, r.probe): r for r in probe_pooled_table(
        pooled, "negation", n_bootstrap=20, reliability=False, heads=heads, flash="1/2")}
    full, flash = flash_scores([ConceptCells(pooled, heads, concept="negation")], ["A1_mean", "S3_iti_probe"],
                               [parse_fraction("1/2")], {"A1_mean": 0, "S3_iti_probe": 0}, seed=0)
    assert full[0].tolist() == [a1.test_auroc, s3.test_auroc]
    assert flash[0, 0].tolist() == [half["A1_mean", "logistic"].test_auroc,
                                    half["S3_iti_probe", "logistic"].test_auroc]
