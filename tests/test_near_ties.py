"""Near-tied layer choices (issue 41): a CV-chosen layer whose margin a couple of pair orders could close is named in
the leaderboard and the findings page, by hand-computed margins, with a real pair flip checking the step size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from poolbench.prober.auroc import auroc
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.results.answer.near_ties import NEAR_TIE_PAIRS, cv_auroc_step, layer_near_tie
from poolbench.results.pages.findings import render_findings


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
    before = {k: v for k, v in committed.items() if k != "near_ties"}
    assert "Near-tied" not in render_findings(before)  # facts from before near-ties render as they did


def test_the_report_marks_a_near_tied_layer_beside_it() -> None:
    from poolbench.results.answer.near_ties import layer_text

    assert layer_text({"best_layer": 14, "layer_near_tie": {"runner_up": 7, "margin": 0.01,
                                                            "pairs_could_close": 0.0125}}) == "14 (near-tie: 7)"
    assert layer_text({"best_layer": 14, "layer_near_tie": None}) == "14"
    assert layer_text({"best_layer": 3}) == "3"  # leaderboards from before near-ties


def _differences_run(tmp_path: Path, differences: list[float]):
    """A finished run of two strategies: A ahead of B by the given held-out AUROC per concept (CV likewise), B's
    concepts of varied difficulty; written and read back through answer.json."""
    from poolbench.config import RunConfig
    from poolbench.records.d1 import D1CellRecord
    from poolbench.records.run import RunOutcome
    from poolbench.results.answer.answer import read_answer
    from poolbench.results.documents.document import write_run_outputs

    b = [0.70 + 0.01 * i for i in range(len(differences))]
    values = {"A": [x + d for x, d in zip(b, differences, strict=True)], "B": b}
    records = [D1CellRecord(concept=f"c{i}", layer=2, strategy=s, probe="logistic", cv_auroc=v, test_auroc=v,
                            ci_low=v - 0.05, ci_high=min(1.0, v + 0.05))
               for s, vs in values.items() for i, v in enumerate(vs)]
    outcome = RunOutcome(config=RunConfig(steering=False, n_bootstrap=100), model={"model_id": "m"},
                         corpus={"hash": "h"}, layers=[2], strategies=[{"id": s, "family": "f"} for s in values],
                         records=records, artifacts={})
    paths = write_run_outputs(outcome, tmp_path, stamp="s")
    return paths, read_answer(paths["answer"])


def test_one_rank_swap_by_hand() -> None:
    from poolbench.prober.verdicts import one_rank_swap, wilcoxon_p

    up, down = one_rank_swap(np.array([0.05, -0.06, 0.07]))  # W+ = 1 + 3 = 4
    assert up.tolist() == [0.06, -0.05, 0.07] and down.tolist() == [-0.05, -0.06, 0.07]  # W+ 5 and 3
    # all six ahead: exact p = 2 / 2^6 = 0.03125; the smallest crossing 0 leaves W- = 1: p = 2 x 2 / 64 = 0.0625
    (swapped,) = one_rank_swap(np.array([0.05, 0.06, 0.07, 0.08, 0.09, 0.10]))
    assert swapped.tolist() == [-0.05, 0.06, 0.07, 0.08, 0.09, 0.10]
    assert wilcoxon_p(swapped)[1] == pytest.approx(4 / 64)


def test_rope_posterior_within_three_monte_carlo_errors_is_a_near_tie() -> None:
    from poolbench.prober.verdicts import rope_near_tie

    se = (0.95 * 0.05 / 20_000) ** 0.5  # 0.00154: three of them reach 0.00462 either side of 0.95
    assert rope_near_tie(0.952, 0.95, 20_000) == (pytest.approx(0.95 - 3 * se), pytest.approx(
        "3 Monte Carlo standard errors of 20000 posterior samples"))
    assert rope_near_tie(0.9456, 0.95, 20_000) is not None and rope_near_tie(0.9453, 0.95, 20_000) is None
    assert rope_near_tie(0.955, 0.95, 20_000) is None and rope_near_tie(0.5, 0.95, 20_000) is None


def test_a_verdict_one_rank_swap_from_holms_alpha_is_named_a_near_tie(tmp_path: Path) -> None:
    """Six concepts all ahead by 0.05-0.10 (well outside the ROPE): Holm p = 0.031 < 0.05, 'worse than the best';
    one swap of signed ranks gives 0.0625, so the verdict is a near-tie, named in answer.json, the printed answer
    and the findings page. Ten such concepts (the should-fail side): p = 2/1024, one swap 4/1024, no near-tie."""
    from poolbench.results.answer.answer import answer_text
    from poolbench.results.pages.findings import findings_facts

    paths, answer = _differences_run(tmp_path / "six", [0.05, 0.06, 0.07, 0.08, 0.09, 0.10])
    assert answer.verdicts is not None
    (b,) = answer.verdicts.comparisons
    assert b.verdict == "worse than the best" and b.holm_p == pytest.approx(2 / 64)
    assert b.near_tie is not None and b.near_tie.boundary == "Wilcoxon-Holm p at α"
    assert (b.near_tie.value, b.near_tie.threshold, b.near_tie.other_side) == pytest.approx((2 / 64, 0.05, 4 / 64))
    assert b.near_tie.other_verdict == "not separated"
    assert json.loads(paths["answer"].read_text())["verdicts"]["comparisons"][0]["near_tie"]["other_verdict"] == \
        "not separated"
    near = ("near-tie: Wilcoxon-Holm p at α, 0.031 against 0.05, within one swap of two neighbouring signed ranks "
            "of 0.062, where it would read 'not separated'")
    text = answer_text(answer)
    assert "B L2: worse than the best (Wilcoxon signed-rank, Holm)" in text and near in text
    assert any(s.startswith("At a test's boundary (near-ties") and "B 'worse than the best'" in s
               for s in answer.sentences)
    results, board = (json.loads(paths[k].read_text()) for k in ("results", "leaderboard"))
    page = render_findings(findings_facts(results, board, source="r", sha256="0" * 64, answer=answer))
    assert "| near-tie |" in page and "Wilcoxon-Holm p at α (0.031 vs 0.05): else 'not separated' |" in page

    _, clear = _differences_run(tmp_path / "ten", [0.05, 0.055, 0.06, 0.065, 0.07, 0.075, 0.08, 0.085, 0.09, 0.1])
    assert clear.verdicts is not None
    (b,) = clear.verdicts.comparisons
    assert b.verdict == "worse than the best" and b.near_tie is None
    assert "near-tie" not in answer_text(clear) and not any("boundary" in s for s in clear.sentences)


def test_findings_carry_no_nemenyi_verdicts() -> None:
    """Nemenyi stays only the critical-difference figure: facts that still hold Nemenyi verdict near-ties (as
    FACTS_VERSION 2 wrote them) render no such section, and near_ties no longer computes them."""
    from poolbench.results.answer import near_ties

    committed = json.loads((Path(__file__).parents[1] / "docs" / "findings.json").read_text())
    old = {"strategy": "B", "beaten": True, "rank_gap": 6.8, "critical_difference": 6.79, "swaps_could_close": 0.12}
    page = render_findings({**committed, "verdict_near_ties": [old]})
    assert "Nemenyi verdicts" not in page and "critical difference 6.79" not in page
    assert not hasattr(near_ties, "nemenyi_near_ties")
    # facts of version 1 (pages made before the verdicts) still word Nemenyi's groups: their page says so
    assert "predate the answer's verdicts: the 'beats' and 'ties' below are Nemenyi's" in render_findings(
        {**committed, "version": 1})
    assert "predate" not in page and "predate" not in render_findings({**committed, "version": 3})


def test_the_cross_model_page_names_a_near_tied_layer_choice() -> None:
    from poolbench.results.answer.cross_model import model_cell_text
    from poolbench.results.pages.cross_model_findings import render_cross_model_findings

    tie = {"runner_up": 7, "margin": 0.01, "pairs_could_close": 0.0125}
    cell = {"mean_d1": 0.7, "ci_low": None, "ci_high": None, "rank": 2.0, "best_layer": 14, "relative_depth": 0.54}
    assert model_cell_text({**cell, "layer_near_tie": tie}) == "0.700 #2 L14 (0.54) (near-tie: L7)"
    assert model_cell_text(cell) == "0.700 #2 L14 (0.54)"  # tables from before near-ties
    committed = json.loads((Path(__file__).parents[1] / "docs" / "across-models-run" / "findings.json").read_text())
    table = committed["cross_model"]
    name = table["models"][1]["name"]
    row = table["rows"][0]
    marked = {**table, "rows": [{**row, "per_model": {**row["per_model"], name: {**row["per_model"][name],
                                                                                  "layer_near_tie": tie}}},
                                *table["rows"][1:]]}
    page = render_cross_model_findings({**committed, "cross_model": marked})
    layer = row["per_model"][name]["best_layer"]
    assert (f"- {name}: {row['strategy']}: layer {layer} is chosen over layer 7 by 0.0100 mean CV AUROC, within the "
            "0.0125 that 2 pairs' order can close: a near-tie") in page
    assert "(near-tie: L7)" in page
    assert "Near-tied layer choices" not in render_cross_model_findings(committed).split("## ")[2]
