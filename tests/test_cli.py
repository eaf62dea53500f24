"""Bad input at the CLI: one line naming the thing, exit 1, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poolbench.corpus.corpus_versions import generate_embedded_corpus
from poolbench.corpus.layout import write_corpus

DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]


def driver(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*DRIVER, *args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, {c: p for c, p in generate_embedded_corpus("tiny").items() if c in ("hedging", "toxicity")})
    return root


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("args,needles", [
    (["--concepts", "hedging,telepathy"], ["unknown concept 'telepathy'"]),
    (["--strategies", "A1,Z9_psychic"], ["unknown strategy 'Z9_psychic'"]),
    (["--model", "/no/such/model"], ["model '/no/such/model' not found"]),
    (["--store", "s3://bucket/x"], ["POOLBENCH_S3_ENDPOINT"]),
    (["--folds", "1"], ["--folds: "]),
])
def test_bad_run_options(corpus_dir, tmp_path, args, needles):
    out = tmp_path / "out"
    result = driver("run", "--corpus", str(corpus_dir), "--out", str(out), "--store", str(tmp_path / "s"), *args)
    assert_one_line_error(result, *needles)
    assert not out.exists()


def test_refusing_s3_endpoint(corpus_dir, tmp_path):
    result = driver("run", "--corpus", str(corpus_dir), "--out", str(tmp_path / "out"), "--store", "s3://poolbench/p",
                    env={"POOLBENCH_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
                         "AWS_SECRET_ACCESS_KEY": "s"})
    assert_one_line_error(result, "http://127.0.0.1:9", "refused")


def test_garbled_corpus_file_is_named_with_its_line(corpus_dir, tmp_path):
    broken = tmp_path / "corpus"
    write_corpus(broken, {"hedging": generate_embedded_corpus("tiny")["hedging"]})
    target = broken / "hedging" / "train_neg.jsonl"
    lines = target.read_text().splitlines()
    lines[2] = lines[2][:-5]
    target.write_text("\n".join(lines) + "\n")
    result = driver("run", "--corpus", str(broken), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "train_neg.jsonl:3")


def test_validate_corpus_exit_codes(corpus_dir, tmp_path):
    ok = driver("validate-corpus", str(corpus_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 error(s)" in ok.stdout
    bad = tmp_path / "bad"
    write_corpus(bad, {"hedging": generate_embedded_corpus("tiny")["hedging"]})
    record = json.loads((bad / "hedging" / "test_pos.jsonl").read_text().splitlines()[0])
    record["label"] = 0
    path = bad / "hedging" / "test_pos.jsonl"
    path.write_text("\n".join([json.dumps(record), *path.read_text().splitlines()[1:]]) + "\n")
    result = driver("validate-corpus", str(bad))
    assert result.returncode == 1
    assert "test_pos.jsonl" in result.stdout and "label" in result.stdout


def test_validate_corpus_checks_the_token_window(corpus_dir, tiny_llama_dir):
    result = driver("validate-corpus", str(corpus_dir), "--tokenizer", str(tiny_llama_dir), "--max-tokens", "8")
    assert result.returncode == 1
    assert "hedging/train_pos.jsonl:1: " in result.stdout


def test_run_display_renders_each_event_by_type():
    from rich.console import Console
    from rich.progress import Progress, TextColumn

    from poolbench.cli.run_display import RunDisplay
    from poolbench.records.events import (
        CellSteered,
        ConceptPooled,
        ConceptProbed,
        ModelBuilding,
        RunPlanned,
        ScorerReady,
        SteeringPlanned,
    )

    console = Console(record=True, width=200, force_terminal=False)
    with Progress(TextColumn("{task.fields[last]}"), console=console, auto_refresh=False) as progress:
        display = RunDisplay(progress)
        for event in (ModelBuilding("embedded"),
                      RunPlanned("tiny", 2, 32, ("hedging", "toxicity"), (0, 1), ("A1_mean", "P1_last"), (11, 12)),
                      ConceptPooled("hedging", skipped=False, seconds=1.25), ConceptPooled("toxicity", skipped=True),
                      ConceptProbed("hedging", skipped=False), SteeringPlanned(cells=2, scorers=3),
                      ScorerReady("toxicity", 0.8349, 2.0), CellSteered("toxicity", "A1_mean", 1, 0.4251, 0.1),
                      CellSteered("toxicity", "P1_last", 0, None, None)):
            display.show(event)
        bars = {t.description: (t.completed, t.total, t.fields["last"]) for t in progress.tasks}
    assert bars == {"pool": (2, 2, "toxicity (cached)"), "probe D1": (1, 2, "hedging (done)"),
                    "scorers": (1, 3, "toxicity (held-out AUROC 0.83)"),
                    "steer D2/D3": (2, 2, "toxicity/P1_last (null)")}
    text = console.export_text()
    assert "preparing model 'embedded' (once: converting its GGUF or training tiny, cached afterwards) ..." in text
    assert "model tiny (2 layers, d=32), 2 concepts, layers [0, 1], 2 strategies, 2 worker(s)" in text


@pytest.mark.parametrize("defect,needles", [
    ("label", ("test_pos.jsonl:1", "label")),  # a label contradicting its file
    ("straddle", ("test_pos.jsonl:1", "matched_pair_id")),  # a pair across train and test would leak into D1
])
def test_run_stops_on_a_corpus_error_before_any_model_loads(tmp_path, defect, needles):
    bad = tmp_path / "bad"
    write_corpus(bad, {"hedging": generate_embedded_corpus("tiny", version=1)["hedging"]})
    path = bad / "hedging" / "test_pos.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    if defect == "label":
        rows[0]["label"] = 0
    else:  # the first test positive takes the matched_pair_id of a train pair
        train_pair = json.loads((bad / "hedging" / "train_pos.jsonl").read_text().splitlines()[0])["matched_pair_id"]
        rows[0]["matched_pair_id"] = train_pair
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = driver("run", "--corpus", str(bad), "--model", str(tmp_path / "no-such-model"),
                    "--out", str(tmp_path / "out"))
    assert_one_line_error(result, *needles)
    assert "no-such-model" not in result.stderr and not (tmp_path / "out").exists()
