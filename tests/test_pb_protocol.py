"""D1 under the official leaderboard's protocol (pb): hand-worked values, the pair leak it has (a should-fail
case: no-signal matched pairs come out far below 0.5 where PoolBench's grouped CV gives about 0.5), the leaderboard
and answer recording the protocol, and export-submission refusing a non-pb D1 unless told to."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from poolbench.errors import PoolBenchError
from poolbench.prober.d1 import cv_auroc
from poolbench.prober.pb_protocol import bootstrap_aurocs, pb_d1, pb_order
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.answer import build_answer
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.results.exports.submission import check_protocol


def test_rows_are_stacked_positives_first_as_the_reference_stacks_them() -> None:
    assert pb_order(np.array([0, 1, 0, 1, 1])).tolist() == [1, 3, 4, 0, 2]


def test_separable_rows_give_one_and_a_zero_width_interval() -> None:
    # every positive is (3, 0), every negative (0, 2): normalised, (1, 0) and (0, 1); each fold's unit DiffMean
    # direction is (1, -1)/sqrt(2), so positives score 1/sqrt(2) and negatives -1/sqrt(2) in every fold
    X = np.array([[3.0, 0.0]] * 10 + [[0.0, 2.0]] * 10)
    y = np.repeat([1, 0], 10)
    result = pb_d1(X, y)
    assert result.auroc == 1.0 and result.ci_low == 1.0 and result.ci_high == 1.0 and result.std == 0.0
    np.testing.assert_allclose(result.oof_scores, np.repeat([1, -1], 10) / np.sqrt(2), rtol=1e-6)
    assert (result.n_pos, result.n_neg, result.n_folds, result.n_bootstrap) == (10, 10, 5, 1000)


def test_bootstrap_aurocs_are_roc_auc_score_of_each_resample_ties_included() -> None:
    rng = np.random.default_rng(3)
    scores = np.round(rng.normal(size=12), 1).astype(np.float32)  # ties
    labels = np.array([1, 1] + [0] * 10)  # 2 of 12: about one resample in nine draws no positive
    draws = np.random.default_rng(42).integers(0, 12, size=(200, 12))
    expected = [roc_auc_score(labels[d], scores[d]) for d in draws if len(np.unique(labels[d])) == 2]
    got = bootstrap_aurocs(scores, labels, draws)
    assert len(got) == len(expected) and len(expected) < 200  # some one-class resamples were skipped
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)  # the same counts, summed in another order


def test_should_fail_no_signal_matched_pairs_leak_below_half() -> None:
    """Twins differing only by noise carry no concept; the reference's shuffled folds put a twin on each side, the
    held-out positive's twin pulls the training negatives' mean toward it, and its score drops: far below 0.5."""
    rng = np.random.default_rng(0)
    centre = rng.normal(size=(40, 16))
    X = np.concatenate([centre + 0.05 * rng.normal(size=centre.shape), centre + 0.05 * rng.normal(size=centre.shape)])
    y, pairs = np.repeat([1, 0], 40), np.tile(np.arange(40), 2)
    leaky = pb_d1(X, y)
    assert leaky.auroc < 0.25 and leaky.ci_high < 0.5
    grouped = cv_auroc(X, y, pairs, "diffmean")  # PoolBench's folds keep each pair on one side
    assert 0.4 < grouped.auroc < 0.6


def pb_cell(concept: str, strategy: str, auroc: float) -> D1CellRecord:
    return D1CellRecord(concept=concept, layer=16, strategy=strategy, probe="diffmean", cv_auroc=auroc,
                        test_auroc=auroc, ci_low=auroc - 0.02, ci_high=auroc + 0.02, n_test=0, protocol="pb")


def test_leaderboard_and_answer_carry_the_protocol() -> None:
    board = build_leaderboard([pb_cell("c1", "A1_mean", 0.8), pb_cell("c2", "A1_mean", 0.7),
                               pb_cell("c1", "P1_last", 0.6), pb_cell("c2", "P1_last", 0.5)])
    assert board["protocol"] == "pb" and board["probe"] == "diffmean"
    assert [(r["strategy"], r["mean_d1"], r["protocol"]) for r in board["strategies"]] == [
        ("A1_mean", pytest.approx(0.75), "pb"), ("P1_last", pytest.approx(0.55), "pb")]
    assert "no held-out test" in board["layer_selection"]
    answer = build_answer({"model": {"model_id": "m"}}, board)
    assert any("cross-validated only" in s for s in answer.sentences)
    default = build_leaderboard([D1CellRecord(concept="c1", layer=0, strategy="A1_mean", probe="logistic",
                                              cv_auroc=0.9, test_auroc=0.8, ci_low=0.7, ci_high=0.9)])
    assert default["protocol"] == "poolbench"
    assert not any("cross-validated only" in s for s in build_answer({}, default).sentences)


def test_export_submission_refuses_another_protocol_unless_told(tmp_path) -> None:
    from poolbench.cli.app import export_submission

    board = build_leaderboard([D1CellRecord(concept="hedging", layer=2, strategy="A1_mean", probe="logistic",
                                            cv_auroc=0.9, test_auroc=0.8, ci_low=0.7, ci_high=0.9)])
    (tmp_path / "leaderboard.json").write_text(json.dumps(board))
    (tmp_path / "results.json").write_text(json.dumps({"strategies": [
        {"id": "A1_mean", "family": "uniform_aggregation", "supervision": "none",
         "description": "Mean of the hidden states of all non-pad tokens."}]}))
    with pytest.raises(PoolBenchError, match=r"protocol 'poolbench'.*rerun with `--protocol pb`"):
        export_submission(strategy="A1_mean", model_key="llama3_8b", run_dir=tmp_path, source="community", out=None,
                          allow_other_protocol=False)
    assert not (tmp_path / "submission_A1_mean.json").exists()
    export_submission(strategy="A1_mean", model_key="llama3_8b", run_dir=tmp_path, source="community", out=None,
                      allow_other_protocol=True)
    submission = json.loads((tmp_path / "submission_A1_mean.json").read_text())
    assert submission["description"].startswith("[D1 here is PoolBench's protocol 'poolbench'")
    assert submission["description"].endswith("Mean of the hidden states of all non-pad tokens.")
    sidecar = json.loads((tmp_path / "submission_A1_mean.protocol.json").read_text())
    assert sidecar["protocol"] == "poolbench" and sidecar["comparable"] is False
    assert check_protocol({**board, "protocol": "pb"}, "x", allow_other=False) == "pb"
    assert check_protocol({k: v for k, v in board.items() if k != "protocol"}, "x", allow_other=True) == "poolbench"
