"""Experiment trackers: a written run folder logged to MLflow (read back with MlflowClient from a local file store)
and to W&B offline (read back from the offline run's own folder: its .wandb record log and the files beside it)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import write_run

from poolbench.errors import PoolBenchError
from poolbench.results.exports.trackers import (
    Trackers,
    log_mlflow,
    log_trackers,
    log_wandb,
    parse_wandb_args,
    tracked_run,
    tracker_options,
)

CONFIG = {"seed": 7, "layers": [0, 1], "corpus_size": "tiny"}
# leaderboard_wide's first columns for test_report's synthetic run: A1_mean's test AUROC is 0.90 at layer 1 for
# hedging, +0.05 toxicity (0.95), -0.05 planning (0.85): mean 0.90; W2_last_k 0.85 at layer 1; P1_last 0.70 at layer 0.
BOARD = [(1, "A1_mean", 1, 0.90), (2, "W2_last_k", 1, 0.85), (3, "P1_last", 0, 0.70)]
FIGURES = {"run0-cd", "run0-heatmap", "run0-layers", "run0-fallback", "run0-alpha", "run0-scorer"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = write_run(tmp_path / "myrun", store=tmp_path / "store")
    results = json.loads((folder / "results.json").read_text())
    results["config"].update(CONFIG)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def _board(columns: list[str], rows: list[list]) -> list[tuple]:
    at = {c: columns.index(c) for c in ("rank", "strategy", "layer", "mean_d1")}
    return [(r[at["rank"]], r[at["strategy"]], r[at["layer"]], round(r[at["mean_d1"]], 6)) for r in rows]


def test_mlflow_run_holds_config_leaderboard_answer_and_figures(run_dir, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    run = tracked_run(run_dir)
    run_id = log_mlflow(run, uri)
    client = MlflowClient(tracking_uri=uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "myrun"
    assert got.data.params["seed"] == "7" and got.data.params["layers"] == "[0, 1]"
    assert got.data.params["model"] == "tiny" and got.data.params["corpus_hash"] == "c0ffee"
    down = Path(client.download_artifacts(run_id, "", str(tmp_path / "down")))
    table = json.loads((down / "leaderboard.json").read_text())
    assert _board(table["columns"], table["data"]) == BOARD
    assert json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "leaderboard.json", "type": "table"}]
    assert (down / "answer.json").read_bytes() == (run_dir / "answer.json").read_bytes()
    assert json.loads((down / "answer.json").read_text())["best"]["strategy"] == "A1_mean"
    assert json.loads((down / "config.json").read_text())["seed"] == 7
    pngs = {p.stem: p.read_bytes() for p in (down / "figures").iterdir()}
    assert set(pngs) == FIGURES and pngs == dict(run.figures)
    assert all(png.startswith(PNG) for png in pngs.values())


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (':W&B', magic 0xBEE1, version 0), then LevelDB's
    log format (32 KiB blocks; each chunk a 7-byte header: CRC, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_run_holds_config_leaderboard_answer_and_figures(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # its staging files, not in $HOME
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    run = tracked_run(run_dir)
    folder = log_wandb(run, parse_wandb_args(f"project=pb,mode=offline,dir={tmp_path / 'wb'},tags=a;b"))
    assert folder.name.startswith("offline-run-")
    records = wandb_records(next(folder.glob("run-*.wandb")))
    started = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["seed"] == 7 and config["layers"] == [0, 1] and config["model"] == "tiny"
    assert started.project == "pb" and started.display_name == "myrun" and list(started.tags) == ["a", "b"]
    saved = {f.path for r in records if r.WhichOneof("record_type") == "files" for f in r.files.files}
    assert "answer.json" in saved
    assert (folder / "files" / "answer.json").read_bytes() == (run_dir / "answer.json").read_bytes()
    (table,) = (folder / "files" / "media" / "table").glob("leaderboard_*.table.json")
    assert any(p.startswith("media/table/leaderboard_") for p in saved)
    data = json.loads(table.read_text())
    assert _board(data["columns"], data["data"]) == BOARD
    images = {p.name.split("_0_")[0]: p.read_bytes() for p in (folder / "files" / "media" / "images" /
                                                               "figures").glob("*.png")}
    assert set(images) == FIGURES and images == dict(run.figures)
    assert next(r for r in records if r.WhichOneof("record_type") == "exit").exit.exit_code == 0


@pytest.mark.parametrize(("text", "says"), [
    ("mode=offline", "no project=... given"),
    ("project=p,colour=red", "unknown key 'colour'"),
    ("project=p,mode=later", "mode 'later'"),
    ("project", "'project' is not key=value"),
])
def test_bad_wandb_args_name_the_key(text, says):
    with pytest.raises(PoolBenchError, match=f"^--wandb-args: .*{says}"):
        parse_wandb_args(text)


DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]


def test_bad_tracker_options_stop_the_cli_in_one_line_before_any_work(tmp_path):
    for option, value, line in [
        ("--wandb-args", "project=p,colour=red", "error: --wandb-args: unknown key 'colour' (one of project, entity, "
                                                 "name, group, job_type, mode, dir, notes, tags, id)"),
        ("--mlflow-uri", "nosuch://x", "error: --mlflow-uri nosuch://x: "),
    ]:
        proc = subprocess.run([*DRIVER, "run", option, value, "--out", str(tmp_path / "r")], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"})
        assert proc.returncode == 1 and not (tmp_path / "r").exists()
        (said,) = proc.stderr.strip().splitlines()
        assert said.startswith(line) and (option == "--wandb-args") == (said == line)


@pytest.mark.slow
def test_a_tiny_run_logs_itself_to_both_trackers(tmp_path, monkeypatch):
    """The driver's hook: `run` on the tiny model, one concept, no steering, with both options (slow: 25 s to
    5 min here, Ray and the model start in a fresh process; the tests above cover what is logged)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    proc = subprocess.run(
        [*DRIVER, "run", "--model", "tiny", "--corpus-size", "tiny", "--concepts", "hedging", "--layers", "1",
         "--strategies", "A1_mean,P1_last", "--no-steering", "--no-reliability", "--n-bootstrap", "100",
         "--folds", "3", "--torch-threads", "1", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "run"),
         "--wandb-args", f"project=pb,mode=offline,dir={tmp_path / 'wb'}", "--mlflow-uri", (tmp_path / "ml").as_uri()],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "ml").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "poolbench"]
    (logged,) = client.search_runs([experiment.experiment_id])
    board = json.loads((tmp_path / "run" / "leaderboard.json").read_text())
    assert logged.data.params["model"] == "tiny" and logged.data.params["n_folds"] == "3"
    assert sorted(a.path for a in client.list_artifacts(logged.info.run_id)) == [
        "answer.json", "config.json", "figures", "leaderboard.json"]
    (wb,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    assert (wb / "files" / "answer.json").read_bytes() == (tmp_path / "run" / "answer.json").read_bytes()
    assert f"logged to MLflow {(tmp_path / 'ml').as_uri()}: run {logged.info.run_id}" in proc.stdout
    assert board  # the run's own leaderboard is there beside what the trackers hold


def test_without_the_options_neither_tracker_is_imported(run_dir):
    code = ("import sys; from pathlib import Path; import poolbench.cli.app, poolbench.api; "
            "from poolbench.results.exports.trackers import log_trackers, tracker_options; "
            f"assert log_trackers(Path({str(run_dir)!r}), tracker_options(None, None)) == []; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert tracker_options(None, "") == Trackers() and log_trackers(run_dir, Trackers()) == []


def test_a_missing_extra_is_named_before_any_work(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(PoolBenchError, match=r"^--wandb-args needs wandb: pip install 'poolbench\[wandb\]'$"):
        tracker_options("project=p", None)
