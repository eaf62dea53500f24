"""`reproduce --profile poolbench-v1`: the official run's settings as a RunConfig, every official strategy mapped to
a registered one, and `--check` diffing a run's mean D1 against the vendored official numbers (MIT, with its
licence file); the real run is gpu/slow-marked (it needs the 7-9B models and the corpus)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from poolbench.driver.reproduce import CHECK_TOLERANCE, check_run, load_profile, profile_config
from poolbench.errors import PoolBenchError
from poolbench.pooler.registry import get_strategy


def test_profile_sets_what_the_official_run_used() -> None:
    profile, _ = load_profile("poolbench-v1")
    expected_layers = {"llama3_8b": (16, 24, 31), "gemma2_9b": (14, 28, 41), "mistral_7b": (8, 16, 24)}
    for key, layers in expected_layers.items():
        cfg = profile_config(profile, key, corpus="corpus", out="out")
        assert cfg.layers == layers and cfg.max_length == 600 and cfg.dtype == "bfloat16"
        assert cfg.model_args == {"attn_implementation": "eager"} and cfg.protocol == "pb"
    assert profile_config(profile, "mistral_7b", corpus="c", out="o").model == "mistralai/Mistral-7B-v0.1"
    assert profile_config(profile, "mistral_7b", corpus="c", out="o", model="/local/m").model == "/local/m"
    with pytest.raises(PoolBenchError, match="no model key 'qwen25_7b'"):
        profile_config(profile, "qwen25_7b", corpus="c", out="o")
    with pytest.raises(PoolBenchError, match="unknown profile 'v9'"):
        load_profile("v9")


def test_every_official_strategy_runs_as_a_registered_reference_computation() -> None:
    profile, official = load_profile("poolbench-v1")
    assert set(profile.strategies) | set(profile.not_reproduced) == set(official["strategies"])
    for reference_id, strategy_id in profile.strategies.items():
        spec = get_strategy(strategy_id)
        assert spec.sink_mode == "keep", reference_id  # the reference never leaves a sink out
    assert profile.strategies["L2_dependency_rel"] == profile.strategies["A1_mean"]  # its lemmatizer is off
    # the official board agrees: its L2 is its A1 on every model
    for board in official["models"].values():
        numbers = board["D1_mean_auroc_per_strategy"]
        assert numbers["L2_dependency_rel"] == numbers["A1_mean"]
    assert (Path(__file__).resolve().parents[1] / "shared" / "data" / "poolbench_v1_official_LICENSE.txt").is_file()


def board(curves: dict[str, dict[str, float]], protocol: str = "pb") -> dict:
    return {"protocol": protocol, "strategies": [{"strategy": s, "layer_curve": c} for s, c in curves.items()]}


def test_check_compares_at_the_official_best_layer_within_the_tolerance() -> None:
    profile, official = load_profile("poolbench-v1")
    # mistral_7b is the board's model_C, best layer 16: A1 0.76758, W4 0.7758, P2 0.5071
    leaderboard = board({"A1_ref_mean": {"8": 0.5, "16": 0.76758 + 0.004, "24": 0.5},
                         "W4_ref_remainder": {"16": 0.7758 - 0.02},
                         "P2_first": {"8": 0.5071}})  # no number at layer 16
    rows = {r.reference_id: r for r in check_run(profile, official, "mistral_7b", leaderboard)}
    assert rows["A1_mean"].within is True and rows["A1_mean"].difference == pytest.approx(0.004)
    assert rows["L2_dependency_rel"].within is True  # the same run's A1_ref_mean against the official L2
    assert rows["W4_hierarchical"].within is False and rows["W4_hierarchical"].difference == pytest.approx(-0.02)
    assert rows["P2_first_token"].within is None and rows["S3_ITI_exact"].strategy == "-"
    assert CHECK_TOLERANCE == 0.01
    with pytest.raises(PoolBenchError, match=r"protocol 'poolbench'.*rerun with `reproduce`"):
        check_run(profile, official, "mistral_7b", board({}, protocol="poolbench"))


def test_check_command_fails_naming_the_strategies_off(tmp_path) -> None:
    from poolbench.cli.reproduce import reproduce

    (tmp_path / "leaderboard.json").write_text(json.dumps(board({"A1_ref_mean": {"31": 0.76732},
                                                                  "A4_norm": {"31": 0.70}})))
    with pytest.raises(PoolBenchError, match=r"1 of 3 strategies differ .* by more than 0.01: A4_norm"):
        reproduce(model_key="llama3_8b", out=tmp_path, check=True, corpus="", profile="poolbench-v1", model=None,
                  store=None, tolerance=None)
    reproduce(model_key="llama3_8b", out=tmp_path, check=True, corpus="", profile="poolbench-v1", model=None,
              store=None, tolerance=0.1)  # within a looser stated tolerance: passes


@pytest.mark.gpu
@pytest.mark.slow
def test_reproduce_mistral_matches_the_official_board(tmp_path) -> None:
    """The real run: Mistral-7B-v0.1 (or POOLBENCH_MISTRAL, a local copy) over the corpus in POOLBENCH_V1_CORPUS
    (docs/reproduce.md), then --check against the official numbers at CHECK_TOLERANCE."""
    from poolbench.cli.reproduce import reproduce

    corpus = os.environ.get("POOLBENCH_V1_CORPUS", "data/poolbench/data/corpora")
    reproduce(model_key="mistral_7b", corpus=corpus, out=tmp_path, check=False, profile="poolbench-v1",
              model=os.environ.get("POOLBENCH_MISTRAL"), store=str(tmp_path / "store"), tolerance=None)
    reproduce(model_key="mistral_7b", out=tmp_path, check=True, corpus="", profile="poolbench-v1", model=None,
              store=None, tolerance=None)
