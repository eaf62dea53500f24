"""`run`'s options are RunConfig's fields: the list users rely on (names, defaults), checked against the command and
the config so neither can gain or lose one alone; the command line gives the config a hand-written one equals; help
shows the groups; a bad value names the option typed."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from poolbench.api import run_config
from poolbench.cli.app import app
from poolbench.cli.run_options import option_names, run_config_of
from poolbench.config import GROUPS, ProbingOptions, RunConfig, resolve_overlap, run_options
from poolbench.errors import PoolBenchError

# Every option of `run` as users type it, with its default (None: not given). A new option is added here, in
# RunConfig's group (its one definition), and nowhere else; this list only says the change was meant.
RUN_OPTIONS: dict[str, object] = {
    "--model": None, "--model-args": None, "--dtype": "auto", "--device": "auto",
    "--corpus": "embedded", "--corpus-size": "small", "--concepts": None, "--limit": None,
    "--layers": None, "--strategies": None, "--sites": None, "--context-lengths": None, "--strategy-module": None,
    "--batch-size": 32, "--max-batch-tokens": None, "--concept-group-tokens": None, "--overlap": None,
    "--max-length": 256, "--store-dtype": "float32", "--dump-activations": False,
    "--seed": 0, "--folds": 5, "--n-bootstrap": 1000, "--reliability": True, "--flash": None,
    "--protocol": "poolbench", "--rope": 0.01,
    "--steering": True, "--full": False, "--allow-weak-scorer": False, "--backend": "transformers",
    "--tensor-parallel-size": 1, "--vllm-eager": False, "--reference-model": "auto", "--capability-task": None,
    "--capability-task-dir": Path("tasks"),
    "--store": None, "--out": "runs/default", "--address": None, "--num-workers": None, "--torch-threads": None,
    "--drop-pooled": False,
    "--log-samples": False, "--wandb-args": None, "--mlflow-uri": None,
}


def run_command():
    return typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]


def test_every_run_option_is_one_config_field_and_the_list_users_rely_on():
    params = {p.opts[0]: p for p in run_command().params if p.opts[0] != "--help"}
    assert list(params) == list(RUN_OPTIONS)  # panel order, then the order each group writes its fields in
    assert set(option_names()) == set(RUN_OPTIONS)
    for name, default in RUN_OPTIONS.items():
        assert params[name].default == default, name
        field = option_names()[name]
        expected = RunConfig.model_fields[field].get_default(call_default_factory=True)
        if default is not None:  # a given default is the field's own (a Path option's folder as the field's str)
            assert default == expected or str(default) == expected, name
    flags = {p.opts[0]: p.secondary_opts for p in run_command().params if p.secondary_opts}
    assert flags == {"--overlap": ["--no-overlap"], "--dump-activations": ["--no-dump-activations"],
                     "--reliability": ["--no-reliability"], "--steering": ["--no-steering"], "--full": ["--no-full"],
                     "--allow-weak-scorer": ["--no-allow-weak-scorer"], "--vllm-eager": ["--no-vllm-eager"],
                     "--log-samples": ["--no-log-samples"], "--drop-pooled": ["--keep-pooled"]}
    # the config's fields that are not options of `run`: the learning curve's sizes
    assert set(RunConfig.model_fields) - set(run_options()) == {"train_limit", "test_limit"}


def test_run_help_shows_the_options_in_their_groups():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    titles = [title for title, _ in GROUPS]
    assert titles == ["Model", "Corpus", "Extraction and pooling", "Probing (D1)", "Steering (D2, D3, capability)",
                      "Store and cluster", "Outputs and tracking"]
    at = [result.output.index(f"─ {title} ─") for title in titles]
    assert at == sorted(at)
    # an option sits in its group's panel: after its title, before the next
    for option, group in (("--folds", 3), ("--protocol", 3), ("--wandb-args", 6), ("--batch-size", 2)):
        where = result.output.index(option)
        assert at[group] < where and (group + 1 == len(at) or where < at[group + 1]), option


def parsed(*args: str) -> tuple[RunConfig, tuple[str, ...]]:
    return run_config_of(run_command().make_context("run", list(args)).params)


def test_the_command_line_gives_the_config_written_by_hand():
    cfg, models = parsed("--model", "a,b", "--model-args", "revision=r1, trust_remote_code=1", "--concepts", "x,y",
                         "--concepts", "z", "--layers", "all", "--folds", "3", "--no-steering", "--no-overlap",
                         "--strategy-module", "p.py", "--out", "runs/here", "--protocol", "pb",
                         "--context-lengths", "4,1", "--sites", "residual,mlp", "--wandb-args", "project=p")
    assert models == ("a", "b")
    assert cfg == RunConfig(model="a", model_args={"revision": "r1", "trust_remote_code": "1"},
                            concepts=("x", "y", "z"), layers="all", n_folds=3, steering=False, overlap=False,
                            strategy_modules=("p.py",), out="runs/here", protocol="pb", context_lengths=(1, 4),
                            sites=("residual", "mlp"), wandb_args="project=p")
    assert cfg.probing == ProbingOptions(n_folds=3, protocol="pb")
    # poolbench.evaluate's options are the same fields by name (lists and paths as a notebook writes them)
    assert run_config(model="a", model_args={"revision": "r1", "trust_remote_code": "1"}, concepts=["x", "y", "z"],
                      layers="all", n_folds=3, steering=False, overlap=False, strategy_modules=[Path("p.py")],
                      out=Path("runs/here"), protocol="pb", context_lengths=[4, 1], sites=["residual", "mlp"],
                      wandb_args="project=p") == cfg
    default, models = parsed()
    assert default == RunConfig() and models == ("embedded",)
    assert parsed("--layers", "1,3")[0].layers == (1, 3)
    assert parsed("--drop-pooled")[0].drop_pooled is True and parsed("--keep-pooled")[0].drop_pooled is False
    # what results.json records: every field but those that change no number (tracking, plugins, capability)
    assert set(cfg.model_dump()) == set(RunConfig.model_fields) - {
        "strategy_modules", "capability_task", "capability_task_dir", "log_samples", "wandb_args", "mlflow_uri"}


@pytest.mark.parametrize("args,message", [
    (("--folds", "1"), "--folds: Input should be greater than or equal to 2"),
    (("--protocol", "reference"), "--protocol: Value error, 'reference' is not one of poolbench, pb"),
    (("--layers", "one"), "--layers: invalid literal for int() with base 10: 'one'"),
    (("--model-args", "revision"), "--model-args: 'revision' is not key=value"),
    (("--context-lengths", "4"), "--context-lengths: Value error, [4]: whole multiples"),
    (("--n-bootstrap", "-1"), "--n-bootstrap: Input should be greater than or equal to 0"),
])
def test_a_bad_value_names_the_option_typed(args, message):
    with pytest.raises(PoolBenchError) as caught:
        parsed(*args)
    assert str(caught.value).startswith(message)


def test_overlap_unset_is_resolved_by_one_rule():
    assert [resolve_overlap(overlap, on_gpu) for overlap in (None, True, False) for on_gpu in (True, False)] == [
        True, False, True, True, False, False]
