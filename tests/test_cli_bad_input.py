"""Bad input and documented defaults at the driver: one line, no traceback, and the defaults work."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner


def test_flash_check_defaults_leave_passages_on_a_default_sized_corpus(tmp_path: Path):
    from reliability_run import cli, make_run

    run = make_run(tmp_path, n_train_pairs=16)  # the embedded small corpus: 16 train pairs per concept
    doc = json.loads((run / "results.json").read_text())
    for cell in doc["cells"]:
        cell["n_train"] = 32
    (run / "results.json").write_text(json.dumps(doc))
    result = CliRunner().invoke(cli(), ["flash-check", "--run", str(run), "--n-bootstrap", "50"])
    assert result.exit_code == 0, result.output
    assert "skipped fractions 1/64" in result.output  # 16 x 1/64 rounds to no pair at all
    fractions = [r["fraction"] for r in json.loads((run / "flash_check.json").read_text())["fractions"]]
    assert fractions == ["1/2", "1/4", "1/8", "1/16", "1/32"]


import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from poolbench.corpus.corpus_versions import generate_embedded_corpus  # noqa: E402
from poolbench.corpus.layout import MAX_TEXT_CHARS, write_corpus  # noqa: E402

DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]


def driver(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DRIVER, *args], capture_output=True, text=True, timeout=300, env={**os.environ})


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "\x1b" not in result.stderr
    return lines[0]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    write_corpus(root, {c: p for c, p in generate_embedded_corpus("tiny").items() if c in ("hedging", "toxicity")})
    return root


def test_a_byte_that_is_not_utf8_is_named_with_line_and_offset(corpus: Path, tmp_path: Path):
    path = corpus / "hedging" / "train_pos.jsonl"
    data = path.read_bytes()
    offset = data.index(b"\n") + 10  # inside the second line's JSON
    path.write_bytes(data[:offset] + b"\xff" + data[offset:])
    needle = f"byte 0xff at byte offset {offset} is not UTF-8"
    line = one_line_error(driver("run", "--corpus", str(corpus), "--out", str(tmp_path / "o")))
    assert f"hedging/train_pos.jsonl:2: {needle}" in line
    assert not (tmp_path / "o").exists()
    result = driver("validate-corpus", str(corpus))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert any(line.startswith(f"error: hedging/train_pos.jsonl:2: -: {needle}") for line in result.stdout.splitlines())


def test_a_stray_folder_at_the_root_is_named(corpus: Path, tmp_path: Path):
    (corpus / "notes").mkdir()
    (corpus / "notes" / "todo.txt").write_text("x")
    line = one_line_error(driver("run", "--corpus", str(corpus), "--out", str(tmp_path / "o")))
    assert "notes: stray folder at the corpus root" in line
    assert "notes: stray folder" in driver("validate-corpus", str(corpus)).stdout
    (corpus / "notes").rename(corpus / "_notes")  # the documented way to keep it there
    assert driver("list", "concepts", "--corpus", str(corpus)).stdout.split() [:1] == ["hedging"]


def test_a_symlink_loop_is_named_not_missing(corpus: Path, tmp_path: Path):
    path = corpus / "toxicity" / "test_neg.jsonl"
    path.unlink()
    os.symlink(path, path)  # points at itself
    line = one_line_error(driver("run", "--corpus", str(corpus), "--out", str(tmp_path / "o")))
    assert "toxicity/test_neg.jsonl: symlink loop" in line


def test_an_over_long_passage_is_refused_by_count(corpus: Path, tmp_path: Path):
    path = corpus / "hedging" / "test_pos.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[0]["text"] = "word " * 2_000_000  # 10 MB
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    line = one_line_error(driver("run", "--corpus", str(corpus), "--out", str(tmp_path / "o")))
    assert f"hedging/test_pos.jsonl:1: field text: 10,000,000 characters, at most {MAX_TEXT_CHARS:,}" in line
