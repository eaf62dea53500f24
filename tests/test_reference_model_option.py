"""`--reference-model` (issue 42 item 7): the fluency guard's judge, from `run` and `steer` to the steerer's
SteeringConfig.reference_model, checked before any model loads; and the findings page's steering table, which
shows steered and prompted fluency under that one guard with a caption rendered from what ran."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.config import RunConfig
from poolbench.errors import PoolBenchError
from poolbench.results.answer.answer import build_answer
from poolbench.results.pages.findings import findings_facts, render_findings
from poolbench.steerer.plan import steering_config


class Stop(PoolBenchError):
    """Raised by a stand-in where the real command would start working."""


def test_run_passes_the_reference_model_into_its_config(monkeypatch, tmp_path):
    import poolbench.api

    seen: list[RunConfig] = []

    def evaluate_config(cfg, **kwargs):
        seen.append(cfg)
        raise Stop("stopped before the run")

    monkeypatch.setattr(poolbench.api, "evaluate_config", evaluate_config)
    args = ["run", "--model", "tiny", "--out", str(tmp_path / "r")]
    result = CliRunner().invoke(app, [*args, "--reference-model", "embedded-gemma"])
    assert result.exit_code != 0 and isinstance(result.exception, Stop)  # main() prints it in one line
    assert seen[-1].reference_model == "embedded-gemma"
    CliRunner().invoke(app, args)
    assert seen[-1].reference_model == "auto"  # the default: the other embedded model
    empty = CliRunner().invoke(app, [*args, "--reference-model", ""])
    assert isinstance(empty.exception, PoolBenchError) and str(empty.exception).startswith("--reference-model: ")
    assert len(seen) == 2  # stopped before the run


def test_the_run_config_reaches_the_steering_config():
    assert steering_config(False, 3, "self").reference_model == "self"
    assert steering_config(True, 0).reference_model == "auto"
    assert steering_config(True, 0, "embedded").to_record()["reference_model"] == "embedded"  # it enters the key


def test_a_missing_reference_model_stops_the_run_in_one_line(tmp_path):
    from poolbench.driver.pipeline import prepare_model

    missing = tmp_path / "no-such-model"
    with pytest.raises(PoolBenchError, match=f"^--reference-model: .*{missing.name}"):
        prepare_model(RunConfig(model="tiny", reference_model=str(missing)), lambda event: None)


def test_steer_passes_the_reference_model_to_its_cell(monkeypatch):
    import poolbench.steerer.single_cell

    seen: list[dict] = []

    def steer_one_cell(*args, **kwargs):
        seen.append(kwargs)
        raise Stop("stopped before steering")

    monkeypatch.setattr(poolbench.steerer.single_cell, "steer_one_cell", steer_one_cell)
    result = CliRunner().invoke(app, ["steer", "--concept", "toxicity", "--strategy", "A1_mean", "--layer", "0",
                                      "--reference-model", "self"])
    assert result.exit_code != 0 and isinstance(result.exception, Stop)
    assert seen[0]["reference_model"] == "self"


def _d2(concept: str, steered: bool, prompted: bool, **extra) -> dict:
    return {"concept": concept, "strategy": "A1_mean", "layer": 1, "status": "ok", "alpha_star": 0.5,
            "d2_delta": 0.2, "d2_delta_ci_low": 0.1, "d2_delta_ci_high": 0.3, "prompted_delta": 0.4,
            "prompted_delta_ci_low": 0.3, "prompted_delta_ci_high": 0.5, "fluency_guard": 2.0,
            "passes_fluency_guard": steered, "prompted_passes_fluency_guard": prompted, **extra}


def test_findings_show_steered_and_prompted_fluency_under_the_guard_that_ran():
    v4 = {"reference_model": "embedded-gemma", "min_distinct_2": 0.5, "backend": "transformers",
          "fluency_measure": "reference perplexity (unconditioned) ratio to alpha = 0, and distinct-2"}
    results = {"model": {"model_id": "m"}, "d2": [_d2("frustration", False, True, **v4),
                                                  _d2("toxicity", True, False, **v4)]}
    board = {"probe": "logistic", "strategies": []}
    page = render_findings(findings_facts(results, board, source="r", sha256="0" * 64,
                                          answer=build_answer(results, board)))
    assert "| concept | strategy | layer | α* | Δ(α*) [95% CI] | prompted Δ [95% CI] | steered fluent | prompted " \
           "fluent |" in page
    cells = "| A1_mean | 1 | 0.500 | +0.200 [+0.100, +0.300] | +0.400 [+0.300, +0.500] |"
    assert f"| frustration {cells} no | yes |" in page and f"| toxicity {cells} yes | no |" in page
    assert ("perplexity under the reference model embedded-gemma, reading each continuation alone without its prompt, "
            "at most 2× that of the α = 0 continuations of the same prompts, and mean distinct-2 (the share of "
            "distinct word bigrams) at least 0.5.") in page
    assert "on the same scorer. Continuations generated on the transformers backend. Fluent" in page
    # a run's other settings are what the caption says, not the defaults
    other = {**v4, "reference_model": "self", "min_distinct_2": 0.3}
    results = {"model": {"model_id": "m"}, "d2": [_d2("toxicity", True, True, **other)]}
    results["d2"][0]["fluency_guard"] = 3.0
    page = render_findings(findings_facts(results, board, source="r", sha256="0" * 64,
                                          answer=build_answer(results, board)))
    assert "reference model self," in page and "at most 3× that" in page and "at least 0.3." in page
    # before D2 v4 the records name no reference model: the caption says the old guard ran
    old = {"model": {"model_id": "m"}, "d2": [_d2("toxicity", True, True)]}
    page = render_findings(findings_facts(old, board, source="r", sha256="0" * 64, answer=build_answer(old, board)))
    assert "under the steered model, after the prompt, at most 2× that of the α = 0 continuations" in page
