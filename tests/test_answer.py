"""The run's answer on constructed results: the best chosen on CV, every other strategy's verdict against it
(a separable field, one the data cannot separate, one strategy alone), and the tidy long / short wide leaderboard
tables written beside leaderboard.json."""

from __future__ import annotations

import csv
import io

import pytest

from poolbench.results.answer.answer import answer_html, answer_text, build_answer
from poolbench.results.documents.tidy import LONG_COLUMNS, WIDE_COLUMNS, long_rows, to_csv, wide_rows

CONCEPTS = ("c1", "c2", "c3", "c4")
# A's held-out AUROC per concept: mean 0.875, sd 0.064550 over 4 concepts, t(0.975, 3) = 3.182446:
# half-width 3.182446 * 0.064550 / 2 = 0.102714 -> [0.772, 0.978].
D1 = {"A": (0.9, 0.8, 0.85, 0.95), "B": (0.85, 0.8, 0.8, 0.9), "C": (0.6, 0.55, 0.5, 0.65)}
CV_SHIFT = {"A": 0.02, "B": 0.0, "C": 0.0}  # CV AUROC = held-out + shift: A is chosen on CV
LEXICAL = (1.0, 1.0, 0.75, 1.0)  # 1.000 on three of four concepts; at or above A's D1 on c1, c2, c4


def documents(d1: dict[str, tuple[float, ...]] | None = None, *, lexical: bool = True, d2: list | None = None
              ) -> tuple[dict, dict]:
    d1 = d1 or D1
    concepts = CONCEPTS if len(next(iter(d1.values()))) == 4 else tuple(f"k{i}" for i in range(len(
        next(iter(d1.values())))))
    rows = [{"strategy": s, "rank": i, "family": "f", "best_layer": 2, "mean_d1": sum(v) / len(v),
             "mean_cv_auroc": sum(v) / len(v) + CV_SHIFT.get(s, 0.0), "win_rate": None,
             "per_concept": {c: {"auroc": a, "cv_auroc": a + CV_SHIFT.get(s, 0.0)}
                             for c, a in zip(concepts, v, strict=True)}}
            for i, (s, v) in enumerate(d1.items(), start=1)]
    results = {"model": {"model_id": "m"}, "config": {"n_bootstrap": 1000, "seed": 0},
               "cells": [{"strategy": s, "layer": L, "concept": c, "probe": probe, "test_auroc": a - 0.1 * (2 - L),
                          "ci_low": a - 0.2, "ci_high": min(1.0, a + 0.05), "cv_auroc": a - 0.01,
                          "fallback_rate": 0.0}
                         for s, v in d1.items() for c, a in zip(concepts, v, strict=True) for L in (1, 2)
                         for probe in ("logistic", "diffmean")]}
    if lexical:
        results["lexical_baseline"] = [{"concept": c, "test_auroc": v, "ci_low": v - 0.1, "ci_high": 1.0}
                                       for c, v in zip(CONCEPTS, LEXICAL, strict=True)]
    if d2 is not None:
        results["d2"] = d2
    return results, {"probe": "logistic", "strategies": rows}


def d2(concept: str, strategy: str, *, status: str = "ok", delta=(0.01, -0.02, 0.04), prompted=(0.09, 0.02, 0.15),
       prompted_ratio: float = 1.2) -> dict:
    return {"concept": concept, "strategy": strategy, "layer": 2, "status": status, "alpha_star": 0.1,
            "null_reason": None if status == "ok" else "zero-norm vector", "fluency_guard": 2.0,
            "d2_delta": delta[0], "d2_delta_ci_low": delta[1], "d2_delta_ci_high": delta[2],
            "prompted_delta": prompted[0], "prompted_delta_ci_low": prompted[1], "prompted_delta_ci_high": prompted[2],
            "prompted_fluency_ratio": prompted_ratio}


def test_separable_field_names_whom_the_best_beats():
    # Eight concepts, B and C below A on every one by distinct amounts: Wilcoxon W = 0, exact p = 2 / 2^8 each;
    # Holm over two: 2 x 2/256 = 0.015625 for both (the second never below the first). Both worse.
    base = (0.9, 0.8, 0.85, 0.95, 0.88, 0.82, 0.91, 0.86)
    d1 = {"A": base, "B": tuple(a - 0.05 - 0.001 * i for i, a in enumerate(base)),
          "C": tuple(a - 0.3 - 0.001 * i for i, a in enumerate(base))}
    answer = build_answer(*documents(d1, lexical=False))
    assert answer.verdict == "separated"
    assert (answer.best.strategy, answer.best.layer, answer.best.n_concepts) == ("A", 2, 8)
    v = answer.verdicts
    assert [(c.strategy, c.verdict) for c in v.comparisons] == [("B", "worse than the best"),
                                                                 ("C", "worse than the best")]
    assert all(c.wilcoxon_p == pytest.approx(2 / 256) and c.holm_p == pytest.approx(4 / 256) for c in v.comparisons)
    assert v.best.confirmation == "confirmed" and v.confidence_set == ("A",)
    # A: mean 0.87125, sd 0.049119 over 8 concepts, t(0.975, 7) = 2.364624: half-width 0.041065.
    assert answer.sentences[0] == ("Best on m, chosen on the training CV alone: A at layer 2, mean CV AUROC 0.891; "
                                   "held-out mean D1 0.871 [0.830, 0.912] over 8 concepts (3 strategies run).")
    assert answer.sentences[2] == ("Worse than the best (2; Wilcoxon signed-rank over 8 concepts, Holm's step-down, "
                                   "α = 0.05): B (Holm p 0.016), C (Holm p 0.016).")
    assert answer.sentences[-1] == "A is ahead of every other strategy (Wilcoxon signed-rank, Holm)."


def test_a_field_four_concepts_cannot_separate_says_so_with_its_tests():
    # A - B over c1..c4: 0.05, 0, 0.05, 0.05 (the zero is dropped): W = 0 of n = 3, exact p = 2/8 = 0.25.
    # A - C: 0.3, 0.25, 0.35, 0.3, all positive: exact p = 2/16 = 0.125. Holm: C 2 x 0.125 = 0.25, B 0.25.
    cells = [d2("c1", "A", prompted_ratio=2.5), d2("c2", "A", status="null", delta=(None, None, None)),
             d2("c3", "A", delta=(0.2, 0.1, 0.3), prompted=(0.0, -0.05, 0.05))]
    answer = build_answer(*documents(d2=cells))
    assert answer.verdict == "set"
    by = {c.strategy: c for c in answer.verdicts.comparisons}
    assert by["B"].wilcoxon_p == pytest.approx(0.25) and by["C"].wilcoxon_p == pytest.approx(0.125)
    assert by["B"].holm_p == pytest.approx(0.25) and by["C"].holm_p == pytest.approx(0.25)
    assert {c.verdict for c in by.values()} == {"not separated"}
    assert (answer.lexical.n_ceiling, answer.lexical.n_at_least_best, answer.lexical.n_concepts) == (3, 3, 4)
    assert answer.lexical.mean.value == pytest.approx(0.9375)
    assert [c.prompted_fluent for c in answer.steering] == [False, True, True]
    assert answer.steering[1].delta is None  # a null vector has no effect to report
    assert answer.sentences[1] == ("The held-out test confirms the choice: no strategy has a higher held-out mean "
                                   "than A (0.875).")
    assert answer.sentences[2].startswith("Not separated from the best (2; neither Wilcoxon-Holm at α = 0.05 nor "
                                          "the ROPE posterior decides): B (Holm p 0.250, P(ROPE) ")
    assert (
        "Lexical baseline (bag of words, no model): mean 0.938 [0.739, 1.000]; 1.000 on 3 of 4 concepts, at or "
        "above A on 3.") in answer.sentences
    # c3's steering CI [0.1, 0.3] lies above 0; prompting's does on c1 and c2 but not c3
    assert ("Steering: Δ(α*) on the held-out prompts lies above 0 (its 95% CI) in 1 of 2 cells (1 null); the "
            "prompted baseline's Δ does in 2 of 3 concepts (prompted text fails the fluency guard on c1)."
            ) in answer.sentences
    assert answer.sentences[-1].endswith("the lexical baseline scores 1.000 on 3 of 4 concepts, so this corpus "
                                         "cannot separate them.")
    assert not any("tie" in s.lower() for s in answer.sentences)
    text = answer_text(answer)
    assert text.splitlines()[0] == "Answer"
    assert "  B L2: not separated (Wilcoxon signed-rank, Holm; Bayesian signed-rank test, ROPE) — best minus it " \
           "+0.037 over 4 concepts; Wilcoxon W 0, p 0.250, Holm p 0.250" in text
    assert "  c1 / A L2: α* 0.100, Δ(α*) +0.010 [-0.020, +0.040]; prompted Δ +0.090 [+0.020, +0.150] (fails the " \
           "fluency guard)" in text
    assert "  c2 / A L2: null steering vector (zero-norm vector)" in text
    page = answer_html(answer)
    assert 'data-verdict="set"' in page and "<td>+0.200 [+0.100, +0.300]</td>" in page
    assert "<td>B</td><td>2</td><td>not separated</td>" in page


def test_two_concepts_give_no_interval_and_the_cv_choice_need_not_top_the_test():
    results, board = documents({s: v[:2] for s, v in D1.items()}, lexical=False)
    for row in board["strategies"]:  # B now wins on CV; A still has the higher held-out mean
        if row["strategy"] == "B":
            row["mean_cv_auroc"] = 0.99
            for v in row["per_concept"].values():
                v["cv_auroc"] = 0.99
    few = build_answer(results, board)
    assert few.best.strategy == "B" and few.best.d1.low is None and few.best.d1.high is None
    assert few.sentences[0] == ("Best on m, chosen on the training CV alone: B at layer 2, mean CV AUROC 0.990; "
                                "held-out mean D1 0.825 (no interval): fewer than 3 concepts over 2 concepts "
                                "(3 strategies run).")
    assert few.verdicts.best.test_top == "A" and few.verdicts.best.confirmation == "not contradicted"
    assert few.sentences[1].startswith("The held-out test does not confirm it: A has the higher held-out mean "
                                       "(0.850 against 0.825)")


def test_one_strategy_is_said_not_tested():
    results, board = documents({"A": D1["A"]}, lexical=False)
    answer = build_answer(results, board)
    assert answer.verdict == "untested" and answer.verdicts is None
    assert answer.sentences[1] == ("Which strategies it is ahead of is not tested: one strategy, nothing to compare "
                                   "it with.")


def parsed(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_tidy_long_and_short_wide_leaderboards():
    results, board = documents()
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

    wide = parsed(to_csv(wide_rows(board, build_answer(results, board).verdicts), WIDE_COLUMNS))
    assert [(r["rank"], r["strategy"], r["verdict"], r["in_confidence_set"]) for r in wide] == [
        ("1", "A", "chosen best", "True"), ("2", "B", "not separated", "False"),
        ("3", "C", "not separated", "False")]
    assert float(wide[0]["mean_cv_auroc"]) == pytest.approx(0.895)
    assert [r["verdict"] for r in parsed(to_csv(wide_rows(board), WIDE_COLUMNS))] == ["", "", ""]
    assert (wide[2]["worst_concept"], float(wide[2]["worst_d1"])) == ("c3", 0.5)


def test_each_corpus_tier_says_whether_it_separates_the_strategies():
    results, board = documents(lexical=False)
    board["by_tier"] = {
        "standard": {"rows": [{"strategy": "A", "layer": 2, "auroc": 0.99, "ci_low": 0.97, "ci_high": 1.0}],
                     "best": "A", "n_others": 2, "n_excluded_by_best": 0, "separates": False,
                     "lexical": {"mean": 1.0, "max": 1.0}},
        "hard": {"rows": [{"strategy": "B", "layer": 1, "auroc": 0.8, "ci_low": 0.7, "ci_high": 0.9}],
                 "best": "B", "n_others": 2, "n_excluded_by_best": 1, "separates": True,
                 "lexical": {"mean": 0.55, "max": 0.62}}}
    answer = build_answer(results, board)
    assert [t.tier for t in answer.tiers] == ["standard", "hard"]
    start = next(i for i, s in enumerate(answer.sentences) if s.startswith("On the standard tier"))
    assert answer.sentences[start:start + 2] == (
        "On the standard tier: best A at layer 2, AUROC 0.990 [0.970, 1.000]; its interval lies above 0 of 2 "
        "others, so this tier does not separate the strategies; lexical baseline mean 1.000, max 1.000.",
        "On the hard tier: best B at layer 1, AUROC 0.800 [0.700, 0.900]; its interval lies above 1 of 2 others, "
        "so this tier separates the strategies; lexical baseline mean 0.550, max 0.620.")
