"""D3 arithmetic: Disent = 1 - dB/dA with the null and clip rules, the neighbour map, D3_rep, DiffMean."""

from __future__ import annotations

import numpy as np
import pytest
from record_samples import d2_record, d3_record

from poolbench.steerer.d3 import d3_rep_flags, disentanglement, massive_dimensions, neighbour_map, neighbours
from poolbench.steerer.errors import SteeringError
from poolbench.steerer.vector import cosine, diffmean_vector, validate_alphas


def test_disent_hand_computed():
    out = disentanglement(0.4, (0.2, 0.6), 0.1)
    assert out["disent_raw"] == pytest.approx(0.75) and out["disent"] == pytest.approx(0.75)
    assert out["disent_null_reason"] is None


def test_disent_clipped_with_raw_kept():
    low = disentanglement(0.4, (0.2, 0.6), 0.6)  # neighbour moved more than the concept: 1 - 1.5
    assert low["disent_raw"] == pytest.approx(-0.5) and low["disent"] == 0.0
    high = disentanglement(0.4, (0.2, 0.6), -0.2)  # neighbour moved away: 1 + 0.5
    assert high["disent_raw"] == pytest.approx(1.5) and high["disent"] == 1.0


@pytest.mark.parametrize("ci", [(-0.1, 0.5), (0.0, 0.3), (None, None), (-0.5, -0.1)])
def test_disent_null_when_delta_a_ci_includes_zero_or_is_missing_or_negative(ci):
    out = disentanglement(0.2, ci, 0.1)
    assert out["disent"] is None and out["disent_raw"] is None and out["disent_null_reason"]


def test_neighbour_map_is_the_issue_table():
    table = neighbour_map()
    assert len(table) == 17
    assert neighbours("hedging") == {"LD": "conditionality", "LC": "academic_tone"}
    assert neighbours("planning") == {"LD": "bureaucratic", "LC": "code_docs"}
    assert all(set(v) == {"LD", "LC"} and set(v.values()) <= set(table) for v in table.values())
    with pytest.raises(SteeringError, match="no D3 neighbours"):
        neighbours("astrology")


def test_d3_rep_cosine():
    assert cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(1 / np.sqrt(2))
    assert cosine(None, np.array([1.0])) is None
    assert cosine(np.zeros(2), np.ones(2)) is None


def test_diffmean_unit_direction_and_raw_norm():
    X = np.array([[3.0, 4.0], [5.0, 4.0], [1.0, 1.0], [1.0, 1.0]])
    v = diffmean_vector(X, np.array([1, 1, 0, 0]), concept="c", strategy="s", layer=0)
    # pos mean (4, 4) - neg mean (1, 1) = (3, 3): norm 3 sqrt 2, direction (1, 1) / sqrt 2.
    assert v.raw_norm == pytest.approx(3 * np.sqrt(2))
    np.testing.assert_allclose(v.direction, [1 / np.sqrt(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(v.with_residual_norm(10.0).delta(0.5), [5 / np.sqrt(2)] * 2, rtol=1e-6)


def test_zero_norm_vector_is_null_with_reason_never_nan():
    X = np.tile([[2.0, -1.0]], (4, 1))  # P2_first on a causal LM: the BOS state for every passage
    v = diffmean_vector(X, np.array([1, 1, 0, 0]), concept="c", strategy="P2_first", layer=1)
    assert v.is_null and "zero-norm" in v.null_reason and v.raw_norm == 0.0
    with pytest.raises(SteeringError, match="is null"):
        v.delta(1.0)


@pytest.mark.parametrize("grid,msg", [([], "empty"), ([0, -0.5], "negative"), ([float("nan")], "non-finite"),
                                      ([0.0], "at least one alpha > 0")])
def test_bad_alpha_grids(grid, msg):
    with pytest.raises(SteeringError, match=msg):
        validate_alphas(grid)


def test_alpha_grid_sorted_with_zero_added():
    assert validate_alphas([1, 0.25, 1]) == (0.0, 0.25, 1.0)
    assert validate_alphas(None) == (0.0, 0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8)


def _leaderboard():
    def row(strategy, d1, layer):
        return {"strategy": strategy, "mean_d1": d1, "best_layer": layer, "layer_curve": {0: d1, 1: d1}}

    return {"strategies": [row("A1_mean", 0.95, 1), row("P1_last", 0.8, 0), row("P2_first", 0.5, 0)]}


def test_default_cells_best_and_worst_informative_strategy():
    from poolbench.steerer.plan import choose_cells, scorer_concepts

    cells = choose_cells(_leaderboard(), ["imdb_sentiment", "toxicity", "hedging"])
    assert [(c.concept, c.strategy, c.layer) for c in cells] == [
        ("imdb_sentiment", "A1_mean", 1), ("imdb_sentiment", "P1_last", 0),
        ("toxicity", "A1_mean", 1), ("toxicity", "P1_last", 0)]
    available = ["imdb_sentiment", "toxicity", "hedging", "narrative", "frustration", "depression"]
    assert scorer_concepts(cells, available) == ["depression", "frustration", "imdb_sentiment", "narrative",
                                                 "toxicity"]


def test_default_cells_steer_the_best_chosen_on_cv_not_the_held_out_leader():
    """A4 leads on the held-out test, L4 on training CV: the answer names L4 as the best, so the "best D1" cell
    steered must be L4's at its layer (steering the held-out leader would pick the best on its own judge)."""
    from poolbench.steerer.plan import choose_cells

    board = _leaderboard()
    board["strategies"][0]["mean_cv_auroc"] = 0.80  # A1_mean: rank 1 on the held-out test
    board["strategies"][1]["mean_cv_auroc"] = 0.90  # P1_last: highest on CV
    board["strategies"][2]["mean_cv_auroc"] = 0.50
    cells = choose_cells(board, ["toxicity"])
    assert [(c.strategy, c.layer, c.why) for c in cells] == [("P1_last", 0, "best D1"), ("A1_mean", 1, "worst D1")]


def test_full_cells_cover_every_strategy_and_optionally_every_layer():
    from poolbench.steerer.plan import choose_cells

    assert len(choose_cells(_leaderboard(), ["a", "b"], full=True)) == 6
    assert len(choose_cells(_leaderboard(), ["a", "b"], full=True, all_layers=True)) == 12
    with pytest.raises(SteeringError, match="no strategies"):
        choose_cells({"strategies": []}, ["a"])


def test_steering_summary_means_over_non_null_cells():
    from poolbench.steerer.plan import steering_summary

    d2 = [d2_record(strategy="A1", concept="a", status="ok", scp=0.4, scp_ci_low=0.1, d2_delta=0.2,
                    fluency_ratio=1.2, relevance=0.3),
          d2_record(strategy="A1", concept="b", status="ok", scp=0.2, scp_ci_low=-0.1, d2_delta=0.0,
                    fluency_ratio=1.0, relevance=0.1),
          d2_record(strategy="P2", concept="a", status="null", scp=None, d2_delta=None, null_reason="zero-norm")]
    d3 = [d3_record(strategy="A1", disent=0.5, d3_rep=0.1), d3_record(strategy="A1", disent=None, d3_rep=0.3)]
    out = steering_summary(d2, d3)
    assert out["A1"]["mean_scp"] == pytest.approx(0.3) and out["A1"]["mean_d2_delta"] == pytest.approx(0.1)
    assert out["A1"]["n_scp_ci_excludes_0"] == 1 and out["A1"]["mean_disent"] == 0.5 and out["A1"]["n_disent"] == 1
    assert out["A1"]["mean_d3_rep"] == pytest.approx(0.2)
    assert out["P2"]["mean_scp"] is None and out["P2"]["n_null_vectors"] == 1


def test_d3_rep_flags_a_vector_whose_norm_sits_on_one_massive_dimension():
    """Two concept directions orthogonal on 575 ordinary dimensions, each carrying 30 on dimension 507 (as P2's
    vectors do): the cosine is 900 / (900 + 1) = 0.9989, all of it dimension 507. Flagged; without it, 0."""
    u, v = np.zeros(576), np.zeros(576)
    u[0], v[1] = 1.0, 1.0
    u[507] = v[507] = 30.0
    assert cosine(u, v) == pytest.approx(900 / 901)
    dims, share = massive_dimensions(u)
    assert 507 in dims and share == pytest.approx(1.0)  # top 3 = {507, 0, and a zero}: all of the norm
    flags = d3_rep_flags(u, v)
    assert flags["d3_rep_massive"] and flags["d3_rep_massive_share"] == pytest.approx(1.0)
    assert flags["d3_rep_without_massive"] is None  # only zeros are left once both top-3 sets go


def test_d3_rep_does_not_flag_a_spread_vector():
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=576), rng.normal(size=576)
    flags = d3_rep_flags(u, v)
    _, share = massive_dimensions(u)
    assert not flags["d3_rep_massive"] and share < 0.1  # the 3 largest of 576 N(0, 1) squares: ~30 / 576
    assert abs(flags["d3_rep_without_massive"]) < 0.15
