"""The learning curve (D1 against training size) and the contenders page: a smaller training size keeps the test
split whole and its training set inside a larger one's; each learned aggregator is read against the card's best
with the answer's verdicts at every size. Hand-made leaderboards: over 8 concepts a learned aggregator 0.10 below
the card's best at every concept is `behind` (Wilcoxon's exact p 2/2^8 < 0.05), 0.10 above it `ahead`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.corpus.passage import Passage
from poolbench.corpus.source import limit_passages
from poolbench.results.answer.learning_curve import curve_sentences, curve_table, learning_curve

CONCEPTS = [f"c{i}" for i in range(8)]


def _row(strategy: str, family: str, base: float, cv: float) -> dict:
    return {"strategy": strategy, "family": family, "best_layer": 1, "mean_cv_auroc": cv,
            "per_concept": {c: {"auroc": base + 0.01 * i, "cv_auroc": cv + 0.01 * i} for i, c in enumerate(CONCEPTS)}}


def _point(n_train: int, learned: float) -> tuple[int, dict, dict]:
    results = {"cells": [{"n_train": n_train}]}
    board = {"strategies": [_row("A4_norm_weighted", "uniform_aggregation", 0.75, 0.76),
                            _row("A1_mean", "uniform_aggregation", 0.70, 0.70),
                            _row("LA1_attention_probe", "learned_aggregation", learned, learned)]}
    return n_train // 2, results, board


def test_a_learned_aggregator_is_read_against_the_card_best_at_each_size() -> None:
    curve = learning_curve([_point(20, 0.65), _point(80, 0.85)], n_bootstrap=200)
    small, large = curve["points"]
    assert small["card_best"] == large["card_best"] == "A4_norm_weighted" and small["n_train"] == [20]
    assert small["learned"]["LA1_attention_probe"]["reading"] == "behind"
    assert large["learned"]["LA1_attention_probe"]["reading"] == "ahead"
    assert large["learned"]["LA1_attention_probe"]["holm_p"] == pytest.approx(2 / 256)
    assert large["learned"]["LA1_attention_probe"]["difference"]["mean"] == pytest.approx(0.10)
    assert curve["overtakes"] == {"LA1_attention_probe": [80]}
    [sentence] = curve_sentences(curve)
    assert sentence.startswith("LA1_attention_probe: ahead of the card's best from 80 training passages per concept")
    table = curve_table(curve)
    assert table[0] == "| strategy | 20 train | 80 train |" and table[2].startswith("| A4_norm_weighted | 0.785 [")
    never = learning_curve([_point(20, 0.65)], n_bootstrap=200)
    assert never["overtakes"] == {"LA1_attention_probe": None}


def test_a_train_limit_keeps_the_test_split_whole_and_smaller_sizes_inside_larger() -> None:
    passages = [Passage(f"{split}{i}{label}", "t", label, "d", 1, f"{split}g{i}", split, "c")
                for split in ("train", "test") for i in range(10) for label in (1, 0)]
    small, large = limit_passages(passages, None, 4), limit_passages(passages, None, 8)
    assert [p.split for p in small].count("train") == 8 and [p.split for p in small].count("test") == 20
    assert {p.id for p in small} <= {p.id for p in large}
    assert all(p.matched_pair_id in {q.matched_pair_id for q in small if q.label == 0} for p in small if p.label)
    assert limit_passages(passages, 6, 4) == [p for p in limit_passages(passages, 6) if p.split == "test" or
                                              p.id in {q.id for q in small}]


def test_a_test_limit_fixes_one_held_out_subset_whatever_the_training_size() -> None:
    """--test-limit 3: 3 test passages per class (their pairs whole), the same 6 at every training size; the train
    split is left to the size alone. Should fail if the bound reached the train split or moved with the size."""
    passages = [Passage(f"{split}{i}{label}", "t", label, "d", 1, f"{split}g{i}", split, "c")
                for split in ("train", "test") for i in range(10) for label in (1, 0)]
    small, large = (limit_passages(passages, None, n, test_limit=3) for n in (4, 8))
    assert [p.id for p in small if p.split == "test"] == [p.id for p in large if p.split == "test"] == [
        "test01", "test11", "test21", "test00", "test10", "test20"]
    assert [p.split for p in small].count("train") == 8 and [p.split for p in large].count("train") == 16
    assert [p.split for p in limit_passages(passages, None, None, test_limit=3)].count("train") == 20


def test_the_contenders_page_reads_sites_and_lengths_from_the_axes_run_and_says_so() -> None:
    """The learned-aggregator section from the main run (17 concepts), the site and length sections from a smaller
    run named beside it: the page names that run's concepts and reads its tables, not the main run's (which has
    none). Should fail if the axes sections were read from the main run."""
    from poolbench.results.pages.contenders import render_contenders

    def board(concepts, **sections):
        return {"strategies": [{"strategy": "A1_mean", "family": "uniform_aggregation",
                                "per_concept": {c: {"auroc": 0.7} for c in concepts}}], **sections}

    main = ({"model": {"model_id": "m"}, "layers": [12, 17], "timing": {"total_s": 600}}, board(CONCEPTS))
    d1 = {"mean": 0.7, "low": 0.6, "high": 0.8}
    sites = {"sites": ["residual", "attn"], "by_site": {"residual": {"A1_mean": {"d1": d1, "layer": 17}},
                                                        "attn": {"A1_mean": {"d1": d1, "layer": 12}}},
             "best_by_site": {"residual": {"strategy": "A1_mean", "layer": 17, "d1": d1},
                              "attn": {"strategy": "A1_mean", "layer": 12, "d1": d1}},
             "verdicts_missing": "2 concepts"}
    axes = ({"model": {"model_id": "m"}, "layers": [17], "timing": {"total_s": 300}},
            board(["c0", "c1"], sites=sites))
    page = render_contenders(*main, [], [], None, None, axes)
    assert "The run: 8 concepts (c0, c1, c2, c3, c4, c5, c6, c7), layers 12, 17, 1 strategies." in page
    assert "a second run of the same model and corpus over 2 concepts (c0, c1), layers 17, 1 strategies (5.0 min" \
        in page
    assert "| A1_mean | 0.700 [0.600, 0.800] (L17) | 0.700 [0.600, 0.800] (L12) |" in page
    assert "This run read no other site" not in page
    assert "This run read no other site" in render_contenders(*main, [], [], None, None)
    assert "Wall time: the run 10.0 min, the learning curve n/a." in page  # every pass computed: a plain time


def test_a_run_that_read_passes_back_from_the_store_says_its_time_is_not_their_cost() -> None:
    from poolbench.results.pages.contenders import wall_time

    computed = {"pooled": 2, "d1": 2, "pooled_skipped": 15, "d1_skipped": 15, "pooled_attn": 17,
                "pooled_skipped_attn": 0}
    assert wall_time(90.0, [{"computed": computed}]) == (
        "1.5 min, with 15 of 34 concept passes read back from the store (computed by an earlier invocation, not in "
        "this time)")
    assert wall_time(90.0, [{"computed": {"pooled": 17, "pooled_skipped": 0}}]) == "1.5 min"


@pytest.mark.slow
def test_the_learning_curve_and_contenders_page_on_the_tiny_model(tiny_llama_dir, local_ray, cache, tmp_path):
    runner = CliRunner()
    curve = tmp_path / "curve"
    result = runner.invoke(app, [
        "learning-curve", "--model", str(tiny_llama_dir), "--corpus", "embedded-v1", "--corpus-size", "tiny",
        "--concepts", "hedging,toxicity", "--strategies", "A1_mean,P1_last,LA3_multimax", "--sizes", "6,all",
        "--n-bootstrap", "50", "--store", str(tmp_path / "store"), "--out", str(curve)])
    assert result.exit_code == 0, result.output
    data = json.loads((curve / "learning_curve.json").read_text())
    assert [p["n_train"] for p in data["points"]] == [[12], [48]]  # 6 pairs' 12 passages; the whole 48
    assert set(data["overtakes"]) == {"LA3_multimax"}
    for point in data["points"]:
        assert point["card_best"] in ("A1_mean", "P1_last") and set(point["learned"]) == {"LA3_multimax"}
    tests = {json.dumps(sorted((c["concept"], c["n_test"]) for c in json.loads((curve / run / "results.json")
                                                                             .read_text())["cells"]))
             for run in ("n6", "all")}
    assert len(tests) == 1  # every size is scored on the same held-out passages
    page = runner.invoke(app, ["contenders", "--run", str(curve / "all"), "--curve", str(curve),
                               "--out", str(tmp_path / "docs")])
    assert page.exit_code == 0, page.output
    text = (tmp_path / "docs" / "contenders.md").read_text()
    assert "## Do the learned aggregators beat the card's best?" in text and "| LA3_multimax |" in text
    assert "This run read no other site" in text


def test_the_page_says_what_the_curve_read() -> None:
    """The curve runs on another corpus than the main run (full, not small) and on a fixed test subset: the page
    says both, read from the curve's own results.json."""
    from poolbench.results.pages.contenders import curve_scope

    doc = {"corpus": {"hash": "8f3ca32e516fabc", "size": "full"}, "config": {"test_limit": 60}, "layers": [17],
           "cells": [{"concept": "hedging"}, {"concept": "academic_tone"}, {"concept": "hedging"}]}
    assert curve_scope([doc]) == (
        "The curve's runs: corpus 8f3ca32e516f (full), 2 concepts (academic_tone, hedging), layers 17; every size is "
        "read on the first 60 test passages per class (pairs whole).\n")
    assert "the whole test split" in curve_scope([{**doc, "config": {}}])
