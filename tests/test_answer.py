"""The run's answer on constructed results: a separable field, a tied one, a Friedman test that rejects nothing,
and the tidy long / short wide leaderboard tables written beside leaderboard.json."""

from __future__ import annotations

import csv
import io

import pytest

from poolbench.results.answer import answer_html, answer_text, build_answer
from poolbench.results.tidy import LONG_COLUMNS, WIDE_COLUMNS, long_rows, to_csv, wide_rows

CONCEPTS = ("c1", "c2", "c3", "c4")
# A's held-out AUROC per concept: mean 0.875, sd 0.064550 over 4 concepts, t(0.975, 3) = 3.182446:
# half-width 3.182446 * 0.064550 / 2 = 0.102714 -> [0.772, 0.978].
D1 = {"A": (0.9, 0.8, 0.85, 0.95), "B": (0.85, 0.8, 0.8, 0.9), "C": (0.6, 0.55, 0.5, 0.65)}
LEXICAL = (1.0, 1.0, 0.75, 1.0)  # 1.000 on three of four concepts; at or above A's D1 on c1, c2, c4


def documents(ranks: dict[str, float], cd: float, p: float, *, lexical: bool = True, d2: list | None = None
              ) -> tuple[dict, dict]:
    rows = [{"strategy": s, "rank": i, "family": "f", "best_layer": 2, "mean_d1": sum(v) / 4, "win_rate": None,
             "per_concept": {c: {"auroc": a} for c, a in zip(CONCEPTS, v, strict=True)}}
            for i, (s, v) in enumerate(D1.items(), start=1)]
    friedman = {"average_ranks": ranks, "critical_difference": cd, "p_value": p, "alpha": 0.05}
    results = {"model": {"model_id": "m"}, "reliability": {"friedman": friedman},
               "cells": [{"strategy": s, "layer": L, "concept": c, "probe": probe, "test_auroc": a - 0.1 * (2 - L),
                          "ci_low": a - 0.2, "ci_high": min(1.0, a + 0.05), "cv_auroc": a - 0.01,
                          "fallback_rate": 0.0}
                         for s, v in D1.items() for c, a in zip(CONCEPTS, v, strict=True) for L in (1, 2)
                         for probe in ("logistic", "diffmean")]}
    if lexical:
        results["lexical_baseline"] = [{"concept": c, "test_auroc": v, "ci_low": v - 0.1, "ci_high": 1.0}
                                       for c, v in zip(CONCEPTS, LEXICAL, strict=True)]
    if d2 is not None:
        results["d2"] = d2
    return results, {"probe": "logistic", "strategies": rows, "friedman": friedman}


def d2(concept: str, strategy: str, *, status: str = "ok", delta=(0.01, -0.02, 0.04), prompted=(0.09, 0.02, 0.15),
       prompted_ratio: float = 1.2) -> dict:
    return {"concept": concept, "strategy": strategy, "layer": 2, "status": status, "alpha_star": 0.1,
            "null_reason": None if status == "ok" else "zero-norm vector", "fluency_guard": 2.0,
            "d2_delta": delta[0], "d2_delta_ci_low": delta[1], "d2_delta_ci_high": delta[2],
            "prompted_delta": prompted[0], "prompted_delta_ci_low": prompted[1], "prompted_delta_ci_high": prompted[2],
            "prompted_fluency_ratio": prompted_ratio}


def test_separable_field_names_whom_the_best_beats():
    # Ranks 1, 2, 3 with CD 0.9: B is 1.0 from A and C 2.0, both beyond the CD.
    answer = build_answer(*documents({"A": 1.0, "B": 2.0, "C": 3.0}, 0.9, 0.01, lexical=False))
    assert answer.verdict == "separated"
    assert (answer.best.strategy, answer.best.layer, answer.best.n_concepts) == ("A", 2, 4)
    assert answer.best.d1.value == pytest.approx(0.875)
    assert answer.best.d1.low == pytest.approx(0.875 - 0.102714, abs=1e-6)
    assert answer.best.d1.high == pytest.approx(0.875 + 0.102714, abs=1e-6)
    assert answer.ranking.beats == ("B", "C") and answer.ranking.ties == ()
    assert answer.sentences == (
        "Best on m: A at layer 2, mean D1 0.875 [0.772, 0.978] over 4 concepts (3 strategies run).",
        "It beats 2 strategies (Nemenyi, CD 0.90 ranks, Friedman p = 0.01): B, C.",
        "A is ahead of every other strategy at Nemenyi's critical difference.")


def test_tied_field_says_the_corpus_cannot_separate_them():
    # CD 1.2: B (1.5) is within it of A (1.0), C (3.0) is not; the words alone score 1.000 on 3 of 4 concepts.
    cells = [d2("c1", "A", prompted_ratio=2.5), d2("c2", "A", status="null", delta=(None, None, None)),
             d2("c3", "A", delta=(0.2, 0.1, 0.3), prompted=(0.0, -0.05, 0.05))]
    answer = build_answer(*documents({"A": 1.0, "B": 1.5, "C": 3.0}, 1.2, 0.02, d2=cells))
    assert answer.verdict == "tied"
    assert answer.ranking.beats == ("C",) and answer.ranking.ties == ("B",)
    assert (answer.lexical.n_ceiling, answer.lexical.n_at_least_best, answer.lexical.n_concepts) == (3, 3, 4)
    assert answer.lexical.mean.value == pytest.approx(0.9375)
    assert [c.prompted_fluent for c in answer.steering] == [False, True, True]
    assert answer.steering[1].delta is None  # a null vector has no effect to report
    assert answer.sentences[1:] == (
        "It beats 1 strategy (Nemenyi, CD 1.20 ranks, Friedman p = 0.02): C.",
        "It ties 1: B.",
        "Lexical baseline (bag of words, no model): mean 0.938 [0.739, 1.000]; 1.000 on 3 of 4 concepts, at or "
        "above A on 3.",
        # c3's steering CI [0.1, 0.3] lies above 0; prompting's does on c1 and c2 but not c3
        "Steering: Δ(α*) on the held-out prompts lies above 0 (its 95% CI) in 1 of 2 cells (1 null); the prompted "
        "baseline's Δ does in 2 of 3 concepts (prompted text fails the fluency guard on c1).",
        "1 strategy is statistically tied with the best; the lexical baseline scores 1.000 on 3 of 4 concepts, so "
        "this corpus cannot separate them.")
    text = answer_text(answer)
    assert text.splitlines()[0] == "Answer"
    assert "  c1 / A L2: α* 0.100, Δ(α*) +0.010 [-0.020, +0.040]; prompted Δ +0.090 [+0.020, +0.150] (fails the " \
           "fluency guard)" in text
    assert "  c2 / A L2: null steering vector (zero-norm vector)" in text
    page = answer_html(answer)
    assert 'data-verdict="tied"' in page and "<td>+0.200 [+0.100, +0.300]</td>" in page


def test_friedman_that_rejects_nothing_ties_everyone_and_two_concepts_give_no_interval():
    results, board = documents({"A": 1.0, "B": 2.0, "C": 3.0}, 0.9, 0.3, lexical=False)
    answer = build_answer(results, board)
    assert answer.ranking.beats == () and answer.ranking.ties == ("B", "C")  # p >= alpha: Nemenyi separates nothing
    assert answer.sentences[-1] == "The data cannot tell any of the 3 strategies apart: this run cannot separate them."
    for row in board["strategies"]:
        row["per_concept"] = {c: row["per_concept"][c] for c in ("c1", "c2")}
    few = build_answer(results, board)
    assert few.best.d1.low is None and few.best.d1.high is None
    assert few.sentences[0] == ("Best on m: A at layer 2, mean D1 0.850 (no interval): fewer than 3 concepts over 2 "
                                "concepts (3 strategies run).")


def test_no_friedman_test_is_said_not_guessed():
    results, board = documents({"A": 1.0}, 0.9, 0.3, lexical=False)
    results["reliability"], board["friedman"] = {}, None
    answer = build_answer(results, board)
    assert answer.verdict == "untested" and answer.ranking is None
    assert answer.sentences[1].startswith("Which strategies it beats is not tested: no Friedman/Nemenyi test")


def parsed(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_tidy_long_and_short_wide_leaderboards():
    results, board = documents({"A": 1.0, "B": 1.5, "C": 3.0}, 1.2, 0.02)
    long = parsed(to_csv(long_rows(results, board), LONG_COLUMNS))
    assert list(long[0]) == list(LONG_COLUMNS)
    # 3 strategies x 2 layers x 4 concepts x 3 metrics present (test_auroc, cv_auroc, fallback_rate) of the
    # logistic probe, 6 per-layer means, 4 lexical rows
    assert len(long) == 3 * 2 * 4 * 3 + 6 + 4
    a1 = next(r for r in long if (r["strategy"], r["layer"], r["concept"], r["metric"]) == ("A", "1", "c1",
                                                                                            "test_auroc"))
    assert float(a1["value"]) == pytest.approx(0.8) and float(a1["low"]) == pytest.approx(0.7)
    mean = next(r for r in long if (r["strategy"], r["layer"], r["metric"]) == ("A", "2", "mean_test_auroc"))
    assert mean["concept"] == "" and float(mean["value"]) == pytest.approx(0.875)
    assert float(mean["low"]) == pytest.approx(0.875 - 0.102714, abs=1e-6)
    lexical = [r for r in long if r["strategy"] == "lexical_baseline"]
    assert [(r["concept"], r["layer"], float(r["value"])) for r in lexical] == [
        ("c1", "", 1.0), ("c2", "", 1.0), ("c3", "", 0.75), ("c4", "", 1.0)]

    wide = parsed(to_csv(wide_rows(board), WIDE_COLUMNS))
    assert [(r["rank"], r["strategy"], r["tie_group"], r["tied_with_best"]) for r in wide] == [
        ("1", "A", "a", ""), ("2", "B", "a", "True"), ("3", "C", "b", "False")]
    assert (wide[2]["worst_concept"], float(wide[2]["worst_d1"])) == ("c3", 0.5)


def test_each_corpus_tier_says_whether_it_separates_the_strategies():
    results, board = documents({"A": 1.0, "B": 2.0, "C": 3.0}, 0.9, 0.01, lexical=False)
    board["by_tier"] = {
        "standard": {"rows": [{"strategy": "A", "layer": 2, "auroc": 0.99, "ci_low": 0.97, "ci_high": 1.0}],
                     "best": "A", "n_others": 2, "n_excluded_by_best": 0, "separates": False,
                     "lexical": {"mean": 1.0, "max": 1.0}},
        "hard": {"rows": [{"strategy": "B", "layer": 1, "auroc": 0.8, "ci_low": 0.7, "ci_high": 0.9}],
                 "best": "B", "n_others": 2, "n_excluded_by_best": 1, "separates": True,
                 "lexical": {"mean": 0.55, "max": 0.62}}}
    answer = build_answer(results, board)
    assert [t.tier for t in answer.tiers] == ["standard", "hard"]
    assert answer.sentences[2:4] == (
        "On the standard tier: best A at layer 2, AUROC 0.990 [0.970, 1.000]; its interval lies above 0 of 2 "
        "others, so this tier does not separate the strategies; lexical baseline mean 1.000, max 1.000.",
        "On the hard tier: best B at layer 1, AUROC 0.800 [0.700, 0.900]; its interval lies above 1 of 2 others, "
        "so this tier separates the strategies; lexical baseline mean 0.550, max 0.620.")
