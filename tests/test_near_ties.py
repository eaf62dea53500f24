"""Near-tied layer choices (issue 41): a CV-chosen layer whose margin a couple of pair orders could close is named in
the leaderboard and the findings page, by hand-computed margins, with a real pair flip checking the step size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from poolbench.prober.auroc import auroc
from poolbench.records.d1 import D1CellRecord
from poolbench.results.findings import render_findings
from poolbench.results.leaderboard import build_leaderboard
from poolbench.results.near_ties import NEAR_TIE_PAIRS, cv_auroc_step, layer_near_tie


def test_one_pair_order_moves_a_cv_auroc_by_the_step() -> None:
    """5 balanced folds of 4 positives and 4 negatives (n_train 40): swapping one adjacent positive-negative pair's
    scores in one fold moves that fold's AUROC by 1/16 and the mean over folds by 1/80 = cv_auroc_step(40, 5)."""
    assert cv_auroc_step(40, 5) == pytest.approx(1 / 80)
    y = np.array([1, 1, 1, 1, 0, 0, 0, 0])
    scores = np.array([8.0, 7.0, 5.0, 4.0, 6.0, 3.0, 2.0, 1.0])  # one negative (6) above two positives
    swapped = scores.copy()
    swapped[[2, 4]] = swapped[[4, 2]]  # the positive at 5 and the negative at 6 trade places
    folds = [auroc(scores, y)] * 5
    flipped = [auroc(swapped, y), *folds[1:]]
    assert abs(np.mean(flipped) - np.mean(folds)) == pytest.approx(cv_auroc_step(40, 5))
    with pytest.raises(ValueError):
        cv_auroc_step(1, 5)


def test_a_margin_two_pairs_can_close_is_a_near_tie_and_a_wider_one_is_not() -> None:
    steps = {"c1": 0.0125, "c2": 0.005}  # the largest step, over 2 concepts: 0.00625 per pair in the mean
    assert NEAR_TIE_PAIRS == 2
    tie = layer_near_tie({3: 0.6, 7: 0.7000, 14: 0.7100}, 14, steps)
    assert tie is not None and tie.runner_up == 7
    assert tie.margin == pytest.approx(0.01) and tie.pairs_could_close == pytest.approx(0.0125)
    assert layer_near_tie({3: 0.6, 7: 0.7000, 14: 0.7130}, 14, steps) is None  # 0.013 > 0.0125: should-fail side
    assert layer_near_tie({14: 0.71}, 14, steps) is None  # one layer: nothing to tie with


def cell(concept: str, layer: int, cv: float, test: float) -> D1CellRecord:
    return D1CellRecord.from_dict({"concept": concept, "layer": layer, "strategy": "W1_first_k", "probe": "logistic",
                                   "cv_auroc": cv, "test_auroc": test, "ci_low": test - 0.05,
                                   "ci_high": test + 0.05, "n_train": 40, "n_folds": 5})


def test_the_leaderboard_and_findings_name_a_near_tied_layer_and_only_that() -> None:
    """Layer 14 leads layer 7 by 0.01 mean CV AUROC; one pair in each concept is 1/80 there, 2 pairs in the mean
    of 2 concepts 0.0125: a near-tie. At a 0.05 lead it is not."""
    near = build_leaderboard([cell("c1", 7, 0.70, 0.60), cell("c2", 7, 0.70, 0.60),
                              cell("c1", 14, 0.71, 0.62), cell("c2", 14, 0.71, 0.62)])
    (row,) = near["strategies"]
    assert row["best_layer"] == 14
    assert row["layer_near_tie"] == {"runner_up": 7, "margin": pytest.approx(0.01),
                                     "pairs_could_close": pytest.approx(0.0125)}
    clear = build_leaderboard([cell("c1", 7, 0.70, 0.60), cell("c2", 7, 0.70, 0.60),
                               cell("c1", 14, 0.75, 0.62), cell("c2", 14, 0.75, 0.62)])
    assert clear["strategies"][0]["layer_near_tie"] is None
    committed = json.loads((Path(__file__).parents[1] / "docs" / "findings.json").read_text())
    facts = {**committed, "near_ties": [{"strategy": "W1_first_k", "layer": 14, **row["layer_near_tie"]}]}
    page = render_findings(facts)
    assert ("W1_first_k: layer 14 is chosen over layer 7 by 0.0100 mean CV AUROC, within the 0.0125 that 2 pairs' "
            "order can close: a near-tie") in page
    assert "Near-tied" not in render_findings({**facts, "near_ties": []})
    assert "Near-tied" not in render_findings(committed)  # facts from before near-ties render as they did


def test_the_report_marks_a_near_tied_layer_beside_it() -> None:
    from poolbench.results.near_ties import layer_text

    assert layer_text({"best_layer": 14, "layer_near_tie": {"runner_up": 7, "margin": 0.01,
                                                            "pairs_could_close": 0.0125}}) == "14 (near-tie: 7)"
    assert layer_text({"best_layer": 14, "layer_near_tie": None}) == "14"
    assert layer_text({"best_layer": 3}) == "3"  # leaderboards from before near-ties


def test_a_nemenyi_verdict_within_two_rank_swaps_of_the_critical_difference_is_named() -> None:
    """17 concepts: one swap moves a mean rank by 1/17, two by 0.118. Against CD 6.79, gaps 6.80 (beaten) and 6.70
    (not separated) are near-ties; 2.0 and 7.0 (0.21 past the CD: the should-fail side) are not."""
    from poolbench.results.near_ties import nemenyi_near_ties

    friedman = {"average_ranks": {"A": 1.0, "B": 7.8, "C": 7.7, "D": 3.0, "E": 8.0}, "critical_difference": 6.79,
                "n_units": 17}
    ties = nemenyi_near_ties(friedman, "A")
    assert [(t["strategy"], t["beaten"]) for t in ties] == [("B", True), ("C", False)]
    assert ties[0]["rank_gap"] == pytest.approx(6.8) and ties[0]["swaps_could_close"] == pytest.approx(2 / 17)
    assert nemenyi_near_ties(None, "A") == [] and nemenyi_near_ties(friedman, "Z") == []
    committed = json.loads((Path(__file__).parents[1] / "docs" / "findings.json").read_text())
    best = committed["leaderboard"][0]["strategy"]
    page = render_findings({**committed, "verdict_near_ties": nemenyi_near_ties(
        {**friedman, "average_ranks": {best: 1.0, "B": 7.8}}, best)})
    assert (f"- {best} beats B by a mean-rank gap of 6.80 against the critical difference 6.79, within the 0.12 "
            "that 2 rank swaps in one concept can move: a near-tie") in page
