"""The report's figures say what the table says: one colour per strategy, a marker distinct within its family, the
layer axis at the probed layers, and the layer curves in the table's metric (test AUROC) with honest intervals."""

from __future__ import annotations

import json

import pytest
from test_report import write_run

from poolbench.results.pages.report_figures import layer_curves, probed_layers, series_styles
from poolbench.results.pages.report_runs import load_runs

CARD = {"position_anchored": ("P1_last", "P2_first"),
        "uniform_aggregation": ("A1_mean", "A2_max", "A3_min", "A4_norm_weighted"),
        "window": ("W1_first_k", "W2_last_k", "W3_middle_k", "W4_hierarchical"),
        "saliency_weighted": ("S1_attention", "S2_gradient", "S3_iti_probe"),
        "structural_linguistic": ("L1_pos_filtered", "L2_dependency_rel", "L3_entity", "L4_clause", "L5_keyword",
                                  "L6_sentence")}


def test_every_card_strategy_has_its_own_colour_and_a_marker_distinct_within_its_family():
    styles = series_styles({s: family for family, members in CARD.items() for s in members})
    assert len({st.color for st in styles.values()}) == 19
    for members in CARD.values():
        assert len({styles[s].marker for s in members}) == len(members)
        assert len({styles[s].linestyle for s in members}) == 1
    assert len({styles[members[0]].marker for members in CARD.values()}) == len(CARD)
    assert len({str(styles[members[0]].linestyle) for members in CARD.values()}) == len(CARD)


def test_layer_curves_are_test_auroc_at_the_probed_layers_and_match_the_table(tmp_path):
    folder = write_run(tmp_path / "run")
    results = json.loads((folder / "results.json").read_text())
    results["layers"] = [0, 1]
    (folder / "results.json").write_text(json.dumps(results))
    (run,) = load_runs(folder)
    assert probed_layers(run) == [0, 1]
    curves = layer_curves(run)
    # test_report's synthetic D1: P1_last is 0.70 at layer 0 and 0.60 at layer 1 (cv = test - 0.01), offsets
    # 0, +0.05, -0.05 over three concepts: sd 0.05, half-width t(0.975, 2) * 0.05 / sqrt(3) = 0.12421.
    (l0, m0, lo0, hi0), (l1, m1, _, _) = curves["P1_last"]
    assert (l0, l1) == (0, 1)
    assert m0 == pytest.approx(0.70) and m1 == pytest.approx(0.60)
    assert (lo0, hi0) == (pytest.approx(0.70 - 0.12421, abs=1e-5), pytest.approx(0.70 + 0.12421, abs=1e-5))
    for row in run.leaderboard["strategies"]:  # at the chosen layer the curve is the table's mean D1
        at = dict((p[0], p[1]) for p in curves[row["strategy"]])
        assert at[row["best_layer"]] == pytest.approx(row["mean_d1"])


def test_no_interval_band_over_two_concepts(tmp_path):
    folder = write_run(tmp_path / "run")
    board = json.loads((folder / "leaderboard.json").read_text())
    for row in board["strategies"]:
        row["per_concept"] = {c: v for c, v in row["per_concept"].items() if c != "planning"}
    (folder / "leaderboard.json").write_text(json.dumps(board))
    (run,) = load_runs(folder)
    assert all(low is None and high is None for curve in layer_curves(run).values() for _, _, low, high in curve)
