"""D2 arithmetic against hand-computed values: SCP and its prompt bootstrap, perplexity ratio, alpha*."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import spearmanr

from poolbench.steerer.d2 import (
    alpha_table,
    choose_alpha,
    d2_summary,
    harmonic_mean,
    paired_delta,
    perplexity,
    prompted_summary,
    scp,
    spearman_rows,
    split_prompts,
)
from poolbench.steerer.errors import SteeringError


def test_scp_hand_computed_with_ties():
    # alpha = [0, 0, 1, 1] has average ranks [1.5, 1.5, 3.5, 3.5]; scores rank [1, 2, 3, 4]:
    # centred [-1, -1, 1, 1] and [-1.5, -0.5, 0.5, 1.5]: cov 4, norms sqrt(4) * sqrt(5) -> 4 / sqrt(20).
    out = scp([0.0, 1.0], np.array([[0.1, 0.2], [0.3, 0.4]]), n_bootstrap=0)
    assert out["scp"] == pytest.approx(4 / math.sqrt(20))
    assert out["scp_ci_low"] is None and out["scp_n_generations"] == 4


def test_spearman_rows_equals_scipy():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(5, 30)).astype(float)
    y = rng.normal(size=(5, 30))
    expected = [spearmanr(a, b).statistic for a, b in zip(x, y, strict=True)]
    np.testing.assert_allclose(spearman_rows(x, y), expected, rtol=1e-12)


def test_scp_bootstrap_over_prompts():
    # Every prompt's score rises with alpha by the same ranks: any resample of prompts keeps rho fixed.
    alphas = [0.0, 0.5, 1.0]
    scores = np.array([[0.0, 0.01, 0.02], [0.5, 0.51, 0.52], [0.9, 0.91, 0.92]])
    out = scp(alphas, scores, n_bootstrap=200, seed=1)
    # 9 points: alpha ranks 2,2,2,5,5,5,8,8,8 and score ranks 1..9 -> rho = 54 / sqrt(54 * 60).
    assert out["scp"] == pytest.approx(54 / math.sqrt(54 * 60))
    assert out["scp_ci_low"] <= out["scp"] <= out["scp_ci_high"]
    assert out["scp_ci_low"] > 0.9


def test_scp_bootstrap_keeps_degenerate_replicates():
    # 6 alphas x 6 prompts = 36 generations; one generation (prompt 0 at the top alpha) carries the whole
    # effect. A resample of prompts that misses prompt 0 has constant scores: it counts as rho = 0, so about
    # (5/6)^6 = 33% of the replicates sit at 0 and the 95% CI starts at 0 instead of excluding it.
    alphas = [0.0, 0.125, 0.25, 0.5, 1.0, 2.0]
    scores = np.zeros((6, 6))
    scores[5, 0] = 1.0
    out = scp(alphas, scores, n_bootstrap=1000, seed=0)
    cols = np.random.default_rng(0).integers(0, 6, size=(1000, 6))
    missing = int(np.sum(~(cols == 0).any(axis=1)))
    assert out["scp_ci_low"] == 0.0 < out["scp"] <= out["scp_ci_high"]
    assert out["scp_degenerate_replicates"] == missing and out["scp_n_bootstrap"] == 1000
    assert 1000 * (5 / 6) ** 6 - 45 < missing < 1000 * (5 / 6) ** 6 + 45  # 3 binomial sigma
    summary = d2_summary(alphas, scores, np.ones((6, 6)), np.ones((6, 6)), np.full((6, 6), 0.5),
                         n_bootstrap=1000, seed=0)
    assert summary["scp_degenerate_replicates"] == missing


def test_scp_constant_scores_is_none_not_nan():
    out = scp([0.0, 1.0], np.full((2, 3), 0.5), n_bootstrap=50)
    assert out["scp"] is None and out["scp_ci_low"] is None


@pytest.mark.parametrize("alphas", [[0.5, 1.0], [0.0, 1.0, 0.5]])
def test_alphas_must_ascend_from_zero(alphas):
    with pytest.raises(SteeringError, match="ascend from 0"):
        scp(alphas, np.zeros((len(alphas), 2)), n_bootstrap=0)


def test_perplexity_is_token_weighted():
    assert perplexity(np.array([2.0, 4.0]), np.array([1, 2])) == pytest.approx(math.e ** 2)
    assert perplexity(np.array([0.0]), np.array([0])) is None


def test_harmonic_mean_and_zero():
    assert harmonic_mean([0.5, 1.0, 1.0]) == pytest.approx(3 / (2 + 1 + 1))
    assert harmonic_mean([0.0, 1.0, 1.0]) == 0.0


def _table():
    # alpha 0: score .1; alpha 1: score .6 with ppl ratio 1.5; alpha 2: score .9 but ppl ratio 3 (> guard 2).
    alphas = [0.0, 1.0, 2.0]
    scores = np.array([[0.1, 0.1], [0.6, 0.6], [0.9, 0.9]])
    n_tok = np.full((3, 2), 10)
    nll = np.stack([np.full(2, 10 * math.log(2.0)), np.full(2, 10 * math.log(3.0)), np.full(2, 10 * math.log(6.0))])
    relevance = np.full((3, 2), 0.5)
    return alphas, scores, nll, n_tok, relevance


def test_alpha_table_and_guarded_choice():
    alphas, scores, nll, n_tok, rel = _table()
    table = alpha_table(alphas, scores, nll, n_tok, rel, np.array([0, 1]))
    assert [r["perplexity"] for r in table] == pytest.approx([2.0, 3.0, 6.0])
    assert [r["fluency_ratio"] for r in table] == pytest.approx([1.0, 1.5, 3.0])
    assert table[1]["fluency01"] == pytest.approx(1 / 1.5)
    assert table[1]["hm"] == pytest.approx(3 / (1 / 0.6 + 1.5 + 2))
    # hm: alpha 0 = 3 / (10 + 1 + 2), alpha 1 = 0.581, alpha 2 = 3 / (1.11 + 3 + 2) = 0.491.
    assert choose_alpha(table, guard=2.0) == (1, "chosen")


def test_guard_excludes_the_best_harmonic_mean():
    table = [{"hm": 0.1, "fluency_ratio": 1.0}, {"hm": 0.4, "fluency_ratio": 1.9},
             {"hm": 0.9, "fluency_ratio": 2.1}, {"hm": 0.95, "fluency_ratio": None}]
    assert choose_alpha(table, guard=2.0) == (1, "chosen")
    assert choose_alpha(table, guard=2.5) == (2, "chosen")


def test_choose_alpha_ties_go_to_smaller_alpha_and_never_to_zero():
    table = [{"hm": 0.5, "fluency_ratio": 1.0}, {"hm": 0.4, "fluency_ratio": 1.0}, {"hm": 0.4, "fluency_ratio": 1.0}]
    assert choose_alpha(table) == (1, "no_alpha_helps")  # alpha = 0 scores best, yet is not a candidate
    unfluent = [{"hm": 0.5, "fluency_ratio": 1.0}, {"hm": 0.9, "fluency_ratio": 3.0}]
    assert choose_alpha(unfluent) == (0, "no_alpha_fluent")


def test_steering_that_does_nothing_reports_no_alpha_helps_and_a_delta_with_ci_around_zero():
    """The should-fail case: scores equal at every alpha (noise only) and perplexity rising with alpha; alpha* > 0 is
    still picked, labelled 'no_alpha_helps', and its held-out Delta's CI covers 0 rather than being 0 by fiat."""
    rng = np.random.default_rng(0)
    alphas = [0.0, 1.0, 2.0]
    scores = np.tile(rng.random(40) * 0.1, (3, 1)) + rng.normal(0, 0.02, (3, 40))
    nll = np.array([[1.0] * 40, [1.2] * 40, [1.4] * 40])
    out = d2_summary(alphas, scores, nll, np.ones((3, 40)), np.full((3, 40), 0.5), n_bootstrap=500, seed=0)
    assert out["alpha_star"] > 0 and out["alpha_star_outcome"] == "no_alpha_helps"
    assert out["d2_delta_ci_low"] < 0 < out["d2_delta_ci_high"]
    assert sum(out["alpha_star_counts"].values()) == out["n_halvings"] == 200
    assert len(out["per_alpha_select"]) == len(out["per_alpha"]) == 3


def test_alpha_star_stability_counts_choices_over_halvings():
    """A clear winner (alpha 1 lifts every prompt, alpha 2 breaks fluency) is chosen on every halving: stability 1."""
    alphas = [0.0, 1.0, 2.0]
    scores = np.array([[0.1] * 10, [0.8] * 10, [0.9] * 10])
    nll = np.array([[1.0] * 10, [1.0] * 10, [5.0] * 10])
    out = d2_summary(alphas, scores, nll, np.ones((3, 10)), np.full((3, 10), 0.5), n_bootstrap=50, seed=0)
    assert out["alpha_star"] == 1.0 and out["alpha_star_outcome"] == "chosen"
    assert out["alpha_star_counts"] == {"1.0": 200} and out["alpha_star_stability"] == 1.0


def test_paired_delta_hand_computed():
    out = paired_delta(np.array([0.5, 0.7, 0.9]), np.array([0.1, 0.2, 0.3]), n_bootstrap=500, seed=0)
    assert out["delta"] == pytest.approx(0.5)  # differences 0.4, 0.5, 0.6
    assert 0.4 - 1e-12 <= out["ci_low"] <= 0.5 <= out["ci_high"] <= 0.6 + 1e-12


def test_split_prompts_disjoint_halves():
    a, b = split_prompts(11, seed=4)
    assert len(a) == 5 and len(b) == 6 and not set(a) & set(b) and set(a) | set(b) == set(range(11))
    with pytest.raises(SteeringError, match="at least 2 prompts"):
        split_prompts(1)


def test_d2_summary_chooses_on_one_half_reports_on_other():
    alphas = [0.0, 1.0]
    # Prompts 0..3; the report half is the complement of the selection half.
    scores = np.array([[0.1, 0.2, 0.1, 0.2], [0.6, 0.8, 0.6, 0.8]])
    nll = np.full((2, 4), 5.0)
    n_tok = np.full((2, 4), 5)
    rel = np.full((2, 4), 0.5)
    out = d2_summary(alphas, scores, nll, n_tok, rel, n_bootstrap=100, seed=0)
    report = out["report_prompts"]
    assert sorted(out["select_prompts"] + report) == [0, 1, 2, 3]
    assert out["alpha_star"] == 1.0 and out["fluency_ratio"] == pytest.approx(1.0)
    assert out["d2_delta"] == pytest.approx(np.mean(scores[1, report] - scores[0, report]))
    assert out["d2_delta_ci_low"] > 0


def test_prompted_summary():
    report = np.array([1, 2])
    out = prompted_summary(np.array([0.0, 0.5, 0.7]), np.full(3, 2.0), np.full(3, 1), np.full(3, 0.3),
                           np.array([0.0, 0.1, 0.1]), np.full(3, 1.0), np.full(3, 1), report, n_bootstrap=10)
    assert out["prompted_score"] == pytest.approx(0.6)
    assert out["prompted_delta"] == pytest.approx(0.5)
    assert out["prompted_fluency_ratio"] == pytest.approx(math.e)  # exp(2) / exp(1)
    assert out["prompted_relevance"] == pytest.approx(0.3)
    assert out["prompted_passes_fluency_guard"] is False  # ratio e > the default guard 2
    again = prompted_summary(np.array([0.0, 0.5, 0.7]), np.full(3, 2.0), np.full(3, 1), np.full(3, 0.3),
                             np.array([0.0, 0.1, 0.1]), np.full(3, 1.0), np.full(3, 1), report, n_bootstrap=10,
                             guard=3.0)
    assert again["prompted_passes_fluency_guard"] is True
