"""The leaderboard picks each strategy's layer on CV AUROC only, then reports held-out AUROC there."""

import pytest

from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard, leaderboard_rows
from poolbench.results.exports.submission import build_submission


def cell(concept, layer, strategy, cv, test, lo=None, hi=None, probe="logistic", fb=0.0):
    return D1CellRecord.from_dict({
        "concept": concept, "layer": layer, "strategy": strategy, "probe": probe, "cv_auroc": cv,
        "test_auroc": test, "ci_low": lo if lo is not None else test - 0.05,
        "ci_high": hi if hi is not None else test + 0.05, "fallback_rate": fb})


CELLS = [
    # A1: layer 1 has the better mean CV (0.85 vs 0.75) though layer 0 has the better test AUROC.
    cell("c1", 0, "A1_mean", 0.70, 0.95), cell("c2", 0, "A1_mean", 0.80, 0.95),
    cell("c1", 1, "A1_mean", 0.90, 0.80), cell("c2", 1, "A1_mean", 0.80, 0.70),
    # P1: only layer 0 ran; c2 falls back for 60% of passages.
    cell("c1", 0, "P1_last", 0.60, 0.62), cell("c2", 0, "P1_last", 0.55, 0.50, fb=0.6),
    # diffmean rows must not leak into the logistic leaderboard.
    cell("c1", 0, "A1_mean", 0.99, 0.99, probe="diffmean"),
]


def test_layer_is_chosen_on_cv_and_d1_is_test_auroc_there():
    lb = build_leaderboard(CELLS)
    a1 = lb["strategies"][0]
    assert a1["strategy"] == "A1_mean"
    assert a1["best_layer"] == 1
    assert a1["mean_d1"] == pytest.approx((0.80 + 0.70) / 2)
    assert a1["mean_cv_auroc"] == pytest.approx(0.85)
    assert a1["layer_curve"] == {0: pytest.approx(0.75), 1: pytest.approx(0.85)}
    assert a1["per_concept"]["c1"] == {"auroc": 0.80, "ci_low": pytest.approx(0.75), "ci_high": pytest.approx(0.85),
                                       "cv_auroc": 0.90, "fallback_rate": 0.0}


def test_ranking_and_fallback_flag():
    lb = build_leaderboard(CELLS)
    assert [r["strategy"] for r in lb["strategies"]] == ["A1_mean", "P1_last"]
    assert [r["rank"] for r in lb["strategies"]] == [1, 2]
    p1 = lb["strategies"][1]
    assert p1["mean_d1"] == pytest.approx(0.56)
    assert p1["fallback_flagged_concepts"] == ["c2"]
    rows = leaderboard_rows(lb)
    assert rows[1] == ["2", "P1_last", "0.560", "0.575", "0", "c2 0.50", "c2"]


def test_leaderboard_is_built_finished_with_comparisons_and_sections():
    """Win rate, average rank and the run's sections come in as inputs; nothing edits the result afterwards."""
    lb = build_leaderboard(CELLS, win_rate={"A1_mean": 1.0}, average_ranks={"A1_mean": 1.0, "P1_last": 2.0},
                           sections={"model": {"model_id": "tiny"}, "friedman": None})
    assert list(lb) == ["probe", "protocol", "layer_selection", "best_on_cv", "best_selection", "ranked_on",
                        "ranking", "strategies", "model", "friedman"]
    assert lb["ranked_on"] == "test_auroc"  # no tier estimand given: ranked on the held-out AUROC
    assert lb["best_on_cv"] == "A1_mean" and "training data only" in lb["best_selection"]
    a1, p1 = lb["strategies"]
    assert list(a1)[-3:] == ["rank", "win_rate", "average_rank"]
    assert (a1["win_rate"], a1["average_rank"], p1["win_rate"], p1["average_rank"]) == (1.0, 1.0, None, 2.0)
    assert "win_rate" not in build_leaderboard(CELLS)["strategies"][0]


def test_diffmean_leaderboard_is_separate():
    lb = build_leaderboard(CELLS, probe="diffmean")
    assert [r["strategy"] for r in lb["strategies"]] == ["A1_mean"]
    assert lb["strategies"][0]["per_concept"] == {
        "c1": {"auroc": 0.99, "ci_low": pytest.approx(0.94), "ci_high": pytest.approx(1.04),
               "cv_auroc": 0.99, "fallback_rate": 0.0}}


def test_submission_takes_the_leaderboard_row_and_validates():
    lb = build_leaderboard([cell("c1", 2, "A1_mean", 0.9, 0.8, 0.7, 0.9)])
    info = {"family": "uniform_aggregation", "supervision": "none", "description": "mean over all real tokens"}
    sub = build_submission(lb, "A1_mean", "llama3_8b", "community", info).model_dump()
    assert sub["strategy_id"] == "A1_mean"
    assert sub["results"] == {"llama3_8b": {"mean_auroc": 0.8, "layer": 2,
                                            "per_concept": {"c1": {"auroc": 0.8, "ci_low": 0.7, "ci_high": 0.9}}}}


@pytest.mark.parametrize("strategy,model_key,message", [
    ("A1_mean", "gpt5", "unknown model key 'gpt5'"),
    ("Z9_nope", "llama3_8b", "strategy 'Z9_nope' is not in the leaderboard"),
])
def test_submission_errors_name_the_thing(strategy, model_key, message):
    from poolbench.errors import PoolBenchError

    lb = build_leaderboard([cell("c1", 0, "A1_mean", 0.9, 0.8)])
    info = {"family": "uniform_aggregation", "description": "mean over all real tokens"}
    with pytest.raises(PoolBenchError, match=message):
        build_submission(lb, strategy, model_key, "community", info)


def test_submission_rejects_short_description():
    from pydantic import ValidationError

    lb = build_leaderboard([cell("c1", 0, "A1_mean", 0.9, 0.8)])
    with pytest.raises(ValidationError):
        build_submission(lb, "A1_mean", "llama3_8b", "community",
                         {"family": "uniform_aggregation", "description": "short"})


def test_lexical_baseline_sits_beside_each_concept():
    from poolbench.records.lexical import LexicalBaselineRecord

    lexical = [LexicalBaselineRecord(concept=c, test_auroc=v, ci_low=v - 0.1, ci_high=1.0, ci_level=0.95, n_train=8,
                                     n_test=4, n_bootstrap=10, n_features=5, C=1.0, features="tfidf")
               for c, v in (("c1", 0.9), ("c2", 0.6))]
    lb = build_leaderboard(CELLS, lexical=lexical)
    p1 = lb["strategies"][1]
    assert p1["per_concept"]["c2"]["lexical_auroc"] == 0.6
    assert lb["lexical_baseline"]["c1"] == {"auroc": 0.9, "ci_low": pytest.approx(0.8), "ci_high": 1.0}
    assert leaderboard_rows(lb)[1][5] == "c2 0.50 (lexical 0.60)"
