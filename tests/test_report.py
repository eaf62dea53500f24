"""The HTML report: built from a synthetic run, rendered in headless Chromium, every figure on screen and not blank."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from browser import CHROMIUM, assert_drawn, figures_on_screen
from record_samples import d2_record, d3_record, scorer_validity

from poolbench.errors import PoolBenchError
from poolbench.prober.reliability import across_cells
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.results.answer.ranking import group_letters, mean_t_interval, tie_groups
from poolbench.results.pages.report import render_report, write_report
from poolbench.results.pages.report_runs import load_runs
from poolbench.results.pages.report_tables import d2_summary, d2_table, d3_table
from poolbench.store.local import LocalStore

CONCEPTS = ("hedging", "toxicity", "planning")
STRATEGIES = ("A1_mean", "P1_last", "W2_last_k")
# test AUROC per strategy and layer (same for every concept but a per-concept offset), cv = test - 0.01
D1 = {"A1_mean": (0.80, 0.90), "P1_last": (0.70, 0.60), "W2_last_k": (0.75, 0.85)}
OFFSET = {"hedging": 0.0, "toxicity": 0.05, "planning": -0.05}


def synthetic_cells() -> list[dict]:
    cells = []
    for concept in CONCEPTS:
        for strategy in STRATEGIES:
            for layer in (0, 1):
                auroc = round(D1[strategy][layer] + OFFSET[concept], 4)
                for probe in ("logistic", "diffmean"):
                    cells.append({"concept": concept, "layer": layer, "strategy": strategy, "probe": probe,
                                  "cv_auroc": auroc - 0.01, "test_auroc": auroc, "ci_low": auroc - 0.05,
                                  "ci_high": min(1.0, auroc + 0.05), "fallback_count": 0,
                                  "fallback_rate": 0.6 if strategy == "W2_last_k" else 0.0})
    return cells


def alpha_row(alpha: float) -> dict:
    return {"alpha": alpha, "score": 0.2 + 0.1 * alpha, "perplexity": 3.0, "fluency_ratio": 1.0, "relevance": 0.5,
            "fluency01": 1.0, "hm": 0.4}


def generations_table(concept: str) -> pa.Table:
    """Steered scores per (alpha, prompt): constant over the report prompts 0-2 at each alpha (0.2 at alpha 0, 0.3 at
    1, 0.4 at 2), a wild score on prompt 3 (selection half) and a prompted row, which the intervals must ignore."""
    rows = [("steered", a, p, 0.2 + 0.1 * a if p < 3 else 5.0) for a in (0.0, 1.0, 2.0) for p in range(4)]
    rows.append(("prompted", 0.0, 0, 9.0))
    kind, alpha, prompt, score = zip(*rows, strict=True)
    return pa.table({"kind": list(kind), "alpha": list(alpha), "prompt_index": list(prompt),
                     f"score_{concept}": list(score)})


def write_run(folder: Path, *, with_d2: bool = True, store: Path | None = None) -> Path:
    cells = synthetic_cells()
    reliability = across_cells(cells)
    results = {"model": {"model_id": "tiny"}, "corpus": {"hash": "c0ffee"}, "git_hash": "abc", "date": "today",
               "cells": cells, "reliability": reliability}
    if with_d2:
        extra = {}
        if store is not None:
            results["config"] = {"store": str(store)}
            extra = {"report_prompts": [0, 1, 2], "select_prompts": [3]}
        results["d2"] = [d2_record(concept=c, strategy=s, layer=1, alphas=[0.0, 1.0, 2.0], alpha_star=1.0,
                                   score_at_alpha_star=0.3, generations_key=f"generations/{c}{s}" if store else None,
                                   per_alpha=[alpha_row(a) for a in (0.0, 1.0, 2.0)], **extra)
                         .to_dict() for c in CONCEPTS[:2] for s in STRATEGIES[:2]]
        results["d2"].append(d2_record(status="null", null_reason="zero-norm", scp=None, d2_delta=None).to_dict())
        results["d3"] = [d3_record(concept=c, neighbour="planning").to_dict() for c in CONCEPTS[:2]]
        results["scorers"] = [scorer_validity(concept=c, min_auroc=0.8).to_dict() for c in CONCEPTS]
        if store is not None:
            opened = LocalStore(store)
            for c in CONCEPTS[:2]:
                for s in STRATEGIES[:2]:
                    opened.put_table(f"generations/{c}{s}", generations_table(c))
    board = build_leaderboard([D1CellRecord.from_dict(c) for c in cells], win_rate=reliability["win_rate"],
                              average_ranks=reliability["friedman"]["average_ranks"])
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "leaderboard.json").write_text(json.dumps(board))
    return folder


ALL_FIGURES = ["run0-cd", "run0-heatmap", "run0-layers", "run0-fallback", "run0-alpha", "run0-scorer"]


def test_report_sections_and_numbers(tmp_path):
    runs = load_runs(write_run(tmp_path / "run"))
    page, figures = render_report(runs)
    assert [f.fig_id for f in figures] == ALL_FIGURES
    assert all(f.png.startswith(b"\x89PNG") and len(f.png) > 5000 for f in figures)
    # Per strategy the CV-best layer: A1 and W2 at layer 1 (cv 0.89, 0.84), P1 at layer 0 (0.69 > 0.59); mean D1
    # over concepts is the layer's value (offsets +0, +0.05, -0.05 cancel), its t-interval mean ± t(0.975, 2) *
    # 0.05 / sqrt(3) = ± 0.1242, clipped at 1. A1 beats both others in all three concepts (the blocks), W2 beats
    # P1 in all: win rates 1, 0.5, 0 and average ranks 1, 2, 3. CD (k = 3, 3 blocks) = 2.343 * sqrt(12 / 18) = 1.913,
    # the figure's bars join A1-W2 and W2-P1. The verdicts: A1 is chosen on CV (0.89); over three concepts
    # Wilcoxon's smallest two-sided p is 2/8 = 0.25, so nothing is separated from it, and the differences (0.05,
    # 0.2) lie beyond the ±0.01 ROPE. W2 falls back on 60% of passages everywhere.
    for row in ("1 A1_mean — 0.900·[0.776,·1.000] 0.890 1 1.000 1.00 chosen·best — — — —",
                "2 W2_last_k — 0.850·[0.726,·0.974] 0.840 1 0.500 2.00 not·separated — — — hedging,·planning,·toxicity",
                "3 P1_last — 0.700·[0.576,·0.824] 0.690 0 0.000 3.00 not·separated — — — —"):
        expected = "".join(f"<td>{v.replace('·', ' ')}</td>" for v in row.split())
        assert f"<tr>{expected}</tr>" in page
    assert "<b>p = 0.0498</b>" in page  # Friedman on ranks 1, 2, 3 in all 3 concepts: chi2 = 6, p = exp(-3)
    for section in ("Run summary", "Leaderboard", "Critical difference", "Fallback rates", "Per concept",
                    "D2: steering", "D3: disentanglement", "Scorer validity", "Strategy definitions"):
        assert f"<h3>{section}</h3>" in page
    assert page.count('<p class="how">') == 12
    # Per concept, hedging (offset 0): A1 first at 0.900 [0.850, 0.950], then W2 (flagged: 60% fallback), P1.
    assert ("<summary><b>hedging</b> — best A1_mean 0.900, median 0.850</summary>"
            "<table class=\"concept\"><thead>") in page
    assert '<tr class="flag"><td>W2_last_k</td><td>1</td><td>0.850 [0.800, 0.900]</td><td>0.840</td>' in page
    assert page.count("data:image/png;base64,") == 6
    assert "http://" not in page and "https://" not in page  # self-contained


def test_tie_groups_and_letters_by_hand():
    # Ranks 1, 1.5, 2.6, 4 with CD 1.2: a-b (0.5) and b-c (1.1) tie, a-c (1.6) and c-d (1.4) do not.
    groups = tie_groups({"d": 4.0, "a": 1.0, "c": 2.6, "b": 1.5}, 1.2)
    assert groups == [["a", "b"], ["b", "c"], ["d"]]
    assert group_letters(groups) == {"a": "a", "b": "ab", "c": "b", "d": "c"}
    assert tie_groups({"x": 1.0, "y": 2.0}, 1.0) == [["x", "y"]]  # a difference of exactly CD is not significant


def test_mean_t_interval_by_hand():
    mean, low, high = mean_t_interval([0.6, 0.7, 0.8])  # sd 0.1, t(0.975, 2) = 4.3027: ± 0.24841
    assert mean == pytest.approx(0.7) and low == pytest.approx(0.45159, abs=1e-5)
    assert high == pytest.approx(0.94841, abs=1e-5)
    assert mean_t_interval([0.9, 0.95, 0.85])[2] == 1.0  # 0.9 + 0.1242 clipped to the AUROC's bound
    assert mean_t_interval([0.7]) == (0.7, None, None)
    assert mean_t_interval([0.6, 0.8]) == (0.7, None, None)  # two concepts: n/a


def test_d2_and_d3_tables_say_every_number_with_its_ci_and_why_null():
    records = [d2_record(concept="toxicity", alpha_star=0.0, d2_delta=0.0, d2_delta_ci_low=0.0, d2_delta_ci_high=0.0,
                         scp=0.31, scp_ci_low=0.12, scp_ci_high=0.5, fluency_ratio=1.0, relevance=0.174,
                         prompted_delta=-0.016, prompted_delta_ci_low=-0.064, prompted_delta_ci_high=0.032,
                         selected_because="best D1"),
               d2_record(concept="toxicity", strategy="W3_middle_k", alpha_star=0.25, d2_delta=0.0021,
                         d2_delta_ci_low=-0.03, d2_delta_ci_high=0.04, scp=0.1, scp_ci_low=-0.09, scp_ci_high=0.29),
               d2_record(status="null", null_reason="zero-norm", scp=None, d2_delta=None)]
    table = d2_table(records)
    assert ("<tr><td>toxicity</td><td>A1_mean</td><td>0</td><td>best D1</td><td>ok</td><td>0.000</td>"
            "<td>0.000 [0.000, 0.000]</td><td>0.310 [0.120, 0.500]</td><td>1.000</td><td>0.174</td>"
            "<td>-0.016 [-0.064, 0.032]</td><td>4</td><td>0.900</td></tr>") in table
    assert '<tr class="null"><td>a</td><td>A1_mean</td><td>0</td><td>—</td><td>null: zero-norm</td>' in table
    summary = d2_summary(records)
    assert "1 with a null steering vector" in summary and "in <b>1 of 2</b>; Δ(α*)'s CI excludes 0 in <b>0 of 2</b>" \
        in summary and "SCP's CI lies above 0 in <b>1 of 2</b>" in summary
    d3 = d3_table([d3_record(delta_a=0.0, delta_a_ci_low=0.0, delta_a_ci_high=0.0, alpha_star=0.0, d3_rep=0.2,
                             disent_null_reason="Delta_A's CI [0, 0] includes 0: no steering effect"),
                   d3_record(relation="LC", delta_a=0.2, delta_a_ci_low=0.1, delta_a_ci_high=0.3, delta_b=0.05,
                             delta_b_ci_low=0.0, delta_b_ci_high=0.1, disent=1.0, disent_raw=1.25,
                             disent_null_reason=None)])
    assert "Disent is null in <b>1 of 2</b>" in d3
    assert ('<tr class="null"><td>a</td><td>A1_mean</td><td>0</td><td>b (LD)</td><td>0.000</td>'
            "<td>0.000 [0.000, 0.000]</td><td>—</td><td>null</td><td>0.200</td>"
            "<td>Delta_A&#x27;s CI [0, 0] includes 0: no steering effect</td></tr>") in d3
    assert ("<td>0.200 [0.100, 0.300]</td><td>0.050 [0.000, 0.100]</td><td>1.000 (raw 1.250)</td><td>—</td>"
            "<td>—</td></tr>") in d3


def test_alpha_intervals_come_from_the_report_prompts_in_the_store(tmp_path):
    run = load_runs(write_run(tmp_path / "run", store=tmp_path / "store"))[0]
    # Constant scores over the report prompts: each interval is the point itself; prompt 3 (5.0) and the prompted
    # row (9.0) would move it if they were read.
    expected = [(0.2, 0.2), (0.3, 0.3), (0.4, 0.4)]
    assert set(run.alpha_ci) == {(c, s, 1) for c in CONCEPTS[:2] for s in STRATEGIES[:2]}
    for intervals in run.alpha_ci.values():
        assert intervals == [pytest.approx(e) for e in expected]
    assert run.alpha_ci_note is None
    _, figures = render_report([run])
    assert next(f for f in figures if f.fig_id == "run0-alpha").caption == \
        "D2 α curves (report half, 95% intervals) — tiny"

    missing = load_runs(tmp_path / "run", store=str(tmp_path / "empty-store"))[0]  # --store overrides the run's
    assert missing.alpha_ci == {}
    assert missing.alpha_ci_note.startswith("per-α intervals need the run's generations, which could not be read")


def test_report_without_d2_or_scorers_says_so(tmp_path):
    _, figures = render_report(load_runs(write_run(tmp_path / "run", with_d2=False)))
    assert [f.fig_id for f in figures] == ["run0-cd", "run0-heatmap", "run0-layers", "run0-fallback"]


def test_report_of_a_folder_of_runs_and_bad_input(tmp_path):
    write_run(tmp_path / "runs" / "a")
    write_run(tmp_path / "runs" / "b", with_d2=False)
    figures = write_report(tmp_path / "runs", tmp_path / "r.html")
    assert {f.fig_id.split("-")[0] for f in figures} == {"run0", "run1"}
    with pytest.raises(PoolBenchError, match=r"no results\.json in"):
        load_runs(tmp_path / "missing")
    bad = tmp_path / "runs" / "a" / "results.json"
    results = json.loads(bad.read_text())
    results["d2"][0]["scp"] = "high"
    bad.write_text(json.dumps(results))
    with pytest.raises(PoolBenchError) as err:
        load_runs(tmp_path / "runs" / "a")
    assert str(err.value) == f"{bad}: D2Record: field 'scp': Input should be a valid number (got 'high')"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium; "
                                            "`make test-deps` does it)")
def test_report_renders_every_figure_in_headless_chromium(tmp_path):
    figures = write_report(write_run(tmp_path / "run", store=tmp_path / "store"), tmp_path / "report.html")
    assert [f.fig_id for f in figures] == ALL_FIGURES
    on_screen, pixels = figures_on_screen(tmp_path / "report.html", tmp_path)
    assert [f["id"] for f in on_screen] == [f.fig_id for f in figures]
    for fig in on_screen:
        assert_drawn(fig, pixels)


def test_report_shows_the_lexical_baseline_and_d1_by_density_and_placement(tmp_path):
    folder = write_run(tmp_path / "run", with_d2=False)
    results = json.loads((folder / "results.json").read_text())
    results["lexical_baseline"] = [
        {"concept": c, "test_auroc": v, "ci_low": v - 0.05, "ci_high": min(1.0, v + 0.05), "ci_level": 0.95,
         "n_train": 48, "n_test": 24, "n_bootstrap": 1000, "n_features": 400, "C": 1.0, "features": "tfidf"}
        for c, v in zip(CONCEPTS, (1.0, 0.7, 0.9), strict=True)]  # CI lows 0.95, 0.65, 0.85: one above 0.9
    results["d1_by_bucket"] = [
        {"strategy": "W2_last_k", "layer": 1, "probe": "logistic", "by": by, "bucket": b, "auroc": a,
         "ci_low": lo, "ci_high": hi, "ci_level": 0.95, "n": 12, "n_pos": 6, "n_neg": 6, "n_concepts": 3,
         "n_bootstrap": 1000, "concept_aurocs": {"hedging": a}}
        for by, b, a, lo, hi in (("density", "1", 0.6, 0.45, 0.75), ("placement", "start", 0.5, 0.5, 0.5),
                                 ("placement", "end", 1.0, 1.0, 1.0))]
    (folder / "results.json").write_text(json.dumps(results))
    page, figures = render_report(load_runs(folder))
    assert [f.fig_id for f in figures] == ["run0-cd", "run0-heatmap", "run0-layers", "run0-fallback", "run0-buckets"]
    # hedging's best D1 is A1_mean 0.900 (offset 0), its lexical baseline 1.0: D1 - lexical = -0.100
    assert ("<tr class=\"flag\"><td>hedging</td><td>1.000 [0.950, 1.000]</td><td>48 / 24</td><td>400</td>"
            "<td>A1_mean</td><td>0.900</td><td>-0.100</td></tr>") in page
    assert "reaches a CI above 0.9 in <b>1 of 3</b> concepts" in page
    assert " · lexical baseline 1.000 [0.950, 1.000]</summary>" in page
    assert ("<tr class=\"null\"><td>W2_last_k</td><td>1</td><td>placement</td><td>start</td>"
            "<td>0.500 [0.500, 0.500]</td><td>12</td><td>6 / 6</td><td>3</td></tr>") in page
    assert ("<tr><td>W2_last_k</td><td>1</td><td>placement</td><td>end</td><td>1.000 [1.000, 1.000]</td>") in page


def test_report_shows_each_tier_with_the_twin_comparison_and_whether_it_separates(tmp_path):
    folder = write_run(tmp_path / "run", with_d2=False)
    board = json.loads((folder / "leaderboard.json").read_text())
    board["by_tier"] = {
        "standard": {"rows": [{"strategy": "A1_mean", "layer": 1, "auroc": 1.0, "ci_low": 1.0, "ci_high": 1.0,
                               "auroc_with_twins": 1.0, "n": 48, "n_concepts": 3}],
                     "best": "A1_mean", "best_above_chance": True, "n_others": 0, "n_excluded_by_best": 0,
                     "excluded_by_best": [], "separates": False, "lexical": {"mean": 1.0, "max": 1.0}},
        "hard": {"rows": [{"strategy": "P1_last", "layer": 0, "auroc": 0.71, "ci_low": 0.6, "ci_high": 0.8,
                           "auroc_with_twins": 0.75, "n": 32, "n_concepts": 3},
                          {"strategy": "A1_mean", "layer": 1, "auroc": 0.52, "ci_low": 0.41, "ci_high": 0.63,
                           "auroc_with_twins": 0.5, "n": 32, "n_concepts": 3}],
                 "best": "P1_last", "best_above_chance": True, "n_others": 1, "n_excluded_by_best": 1,
                 "excluded_by_best": ["A1_mean"], "separates": True, "lexical": {"mean": 0.5, "max": 0.5}}}
    (folder / "leaderboard.json").write_text(json.dumps(board))
    page, _ = render_report(load_runs(folder))
    hard = page.index("<h4>hard tier</h4>")
    assert page.index("<h4>standard tier</h4>") < hard
    assert ("<p>best P1_last: its interval lies above 1 of 1 others, so this tier <b>separates</b> strategies; "
            "lexical baseline mean 0.500, max 0.500.</p>") in page
    assert "<tr><td>P1_last</td><td>0</td><td>0.710 [0.600, 0.800]</td><td>0.750</td><td>32</td></tr>" in page
    assert ("<tr class=\"null\"><td>A1_mean</td><td>1</td><td>0.520 [0.410, 0.630]</td><td>0.500</td><td>32</td>"
            "</tr>") in page
    assert "so this tier does <b>not</b> separate them" in page[:hard]


def test_report_without_tiers_says_so(tmp_path):
    page, _ = render_report(load_runs(write_run(tmp_path / "run", with_d2=False)))
    assert "No D1 by tier: the corpus marks no tiers" in page
