"""A finished run folder logged to an experiment tracker: W&B (`--wandb-args`) and MLflow (`--mlflow-uri`).

Each tracker gets the same four things, read from the folder the run wrote: the run's config (results.json's
`config`, with model, corpus hash and git hash beside it), the leaderboard as a table (leaderboard_wide.csv's
rows and columns), the answer (answer.json, as a file) and the report's figures (the PNG bytes report.py inlines).
wandb and mlflow are optional extras (`pip install poolbench[wandb]`, `[mlflow]`), imported only inside the
function that logs to them: a run without the options imports neither.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from poolbench.errors import PoolBenchError
from poolbench.results.answer.answer import ANSWER_FILE, run_answer
from poolbench.results.documents.tidy import WIDE_COLUMNS, wide_rows

# wandb.init's keyword arguments that --wandb-args may set (lm-evaluation-harness's `--wandb_args` passes any);
# `tags` is a `;`-separated list, the rest strings.
WANDB_KEYS = ("project", "entity", "name", "group", "job_type", "mode", "dir", "notes", "tags", "id")
WANDB_MODES = ("online", "offline", "disabled", "shared")
MLFLOW_EXPERIMENT = "poolbench"


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker logs of one run folder."""

    name: str  # the folder's name
    config: dict[str, object]
    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]  # the leaderboard, one row per strategy, in `columns` order
    answer_path: Path
    figures: tuple[tuple[str, bytes], ...]  # (figure id, PNG bytes), as the report embeds them


def parse_wandb_args(text: str) -> dict[str, str | list[str]]:
    """`project=p,mode=offline,...` as wandb.init's keyword arguments; a bad item stops in one line naming it."""
    args: dict[str, str | list[str]] = {}
    for item in (part for part in text.split(",") if part.strip()):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise PoolBenchError(f"--wandb-args: '{item.strip()}' is not key=value")
        if key not in WANDB_KEYS:
            raise PoolBenchError(f"--wandb-args: unknown key '{key}' (one of {', '.join(WANDB_KEYS)})")
        if key == "mode" and value not in WANDB_MODES:
            raise PoolBenchError(f"--wandb-args: mode '{value}' is not one of {', '.join(WANDB_MODES)}")
        args[key] = [t for t in value.split(";") if t] if key == "tags" else value
    if "project" not in args:
        raise PoolBenchError("--wandb-args: no project=... given")
    return args


def tracked_run(run_dir: Path, store: str | None = None) -> TrackedRun:
    """The config, leaderboard table, answer and figures of a written run folder."""
    from poolbench.results.pages.report import render_report
    from poolbench.results.pages.report_runs import load_runs

    try:
        results = json.loads((run_dir / "results.json").read_text())
        leaderboard = json.loads((run_dir / "leaderboard.json").read_text())
    except (OSError, ValueError) as exc:
        raise PoolBenchError(f"{run_dir}: no readable results.json and leaderboard.json ({exc})") from None
    answer = run_answer(run_dir, results, leaderboard)
    answer_path = run_dir / ANSWER_FILE
    if not answer_path.is_file():  # a run written before answers were stored: write it, the tracker logs a file
        from poolbench.results.answer.answer import write_answer

        write_answer(answer, answer_path)
    config = dict(results.get("config") or {})
    config.update({"model": (results.get("model") or {}).get("model_id"),
                   "corpus_hash": (results.get("corpus") or {}).get("hash"), "git_hash": results.get("git_hash")})
    rows = wide_rows(leaderboard, answer.verdicts)
    _, figures = render_report(load_runs(run_dir, store))
    return TrackedRun(run_dir.name, config, WIDE_COLUMNS, tuple(tuple(r.get(c) for c in WIDE_COLUMNS) for r in rows),
                      answer_path, tuple((f.fig_id, f.png) for f in figures))


def log_wandb(run: TrackedRun, args: dict[str, str | list[str]]) -> Path:
    """One W&B run: config, `leaderboard` table, answer.json saved with the run, one image per figure; returns the
    run's local folder (offline: wandb/offline-run-*/, which `wandb sync` uploads later). Ends this process's wandb
    service: for the CLI, which logs once at its end."""
    import wandb

    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
    kwargs = {"name": run.name, **args}
    wb = wandb.init(config=run.config, settings=settings, reinit="create_new", **kwargs)  # type: ignore[arg-type]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            log: dict[str, object] = {"leaderboard": wandb.Table(columns=list(run.columns),
                                                                 data=[list(r) for r in run.rows])}
            for fig_id, png in run.figures:
                path = Path(tmp) / f"{fig_id}.png"
                path.write_bytes(png)
                log[f"figures/{fig_id}"] = wandb.Image(str(path))
            wb.log(log)
        wb.save(str(run.answer_path), base_path=str(run.answer_path.parent), policy="now")
        return Path(wb.dir).parent
    finally:
        wb.finish()
        # finish() returns before wandb's service has written the run's records (the offline .wandb file holds only
        # its header then): ending the service flushes them, so the folder is whole when this returns.
        wandb.teardown()


def log_mlflow(run: TrackedRun, uri: str) -> str:
    """One MLflow run in experiment `poolbench` at tracking URI `uri`: the config as params (and config.json),
    leaderboard.json as an MLflow table, answer.json, figures/<id>.png; returns the run id."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    experiment = found.experiment_id if found else client.create_experiment(MLFLOW_EXPERIMENT)
    run_id = client.create_run(experiment, run_name=run.name).info.run_id
    status = "FAILED"
    try:
        for key, value in run.config.items():
            client.log_param(run_id, key, json.dumps(value) if isinstance(value, dict | list) else str(value))
        client.log_dict(run_id, run.config, "config.json")
        client.log_table(run_id, {c: [r[i] for r in run.rows] for i, c in enumerate(run.columns)},
                         "leaderboard.json")
        client.log_artifact(run_id, str(run.answer_path))
        with tempfile.TemporaryDirectory() as tmp:
            for fig_id, png in run.figures:
                (Path(tmp) / f"{fig_id}.png").write_bytes(png)
            client.log_artifacts(run_id, tmp, "figures")
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status)
    return run_id


@dataclass(frozen=True)
class Trackers:
    """Where `run` logs: wandb.init's arguments (None: not to W&B) and an MLflow tracking URI (None: not there)."""

    wandb: dict[str, str | list[str]] | None = None
    mlflow_uri: str | None = None


def tracker_options(wandb_args: str | None, mlflow_uri: str | None) -> Trackers:
    """The CLI's two options, checked before any work: a bad key, a missing extra or an MLflow URI that names no
    store it can open (mlflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true) stops in one line."""
    from importlib.util import find_spec

    trackers = Trackers(None if wandb_args is None else parse_wandb_args(wandb_args), mlflow_uri or None)
    for option, module, used in (("--wandb-args", "wandb", trackers.wandb), ("--mlflow-uri", "mlflow", mlflow_uri)):
        if used is not None and find_spec(module) is None:
            raise PoolBenchError(f"{option} needs {module}: pip install 'poolbench[{module}]'")
    if trackers.mlflow_uri:
        from mlflow import MlflowClient

        try:
            MlflowClient(tracking_uri=trackers.mlflow_uri)
        except Exception as exc:  # mlflow raises its own and its stores' errors
            raise PoolBenchError(f"--mlflow-uri {trackers.mlflow_uri}: {_first_line(exc)}") from None
    return trackers


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def log_trackers(run_dir: Path, trackers: Trackers, store: str | None = None) -> list[str]:
    """The driver's hook once a run folder is written: log it where the options say; one line per tracker. A
    tracker's failure stops in one line naming it (the run folder is complete by then)."""
    if trackers.wandb is None and not trackers.mlflow_uri:
        return []
    run, lines = tracked_run(run_dir, store), []
    if trackers.wandb is not None:
        try:
            lines.append(f"logged to W&B: {log_wandb(run, trackers.wandb)}")
        except Exception as exc:  # wandb's errors are its own
            raise PoolBenchError(f"--wandb-args: {_first_line(exc)} (the run is in {run_dir})") from None
    if trackers.mlflow_uri:
        try:
            lines.append(f"logged to MLflow {trackers.mlflow_uri}: run {log_mlflow(run, trackers.mlflow_uri)}")
        except Exception as exc:
            raise PoolBenchError(f"--mlflow-uri {trackers.mlflow_uri}: {_first_line(exc)} (the run is in "
                                 f"{run_dir})") from None
    return lines
