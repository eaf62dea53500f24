"""Each bench script, run as a person runs it, on the test model and a few tiny-corpus passages: it finishes, and
its JSON has the fields the README and bench/README describe, with counts that follow from the options and
ratios that are positive and finite. What the numbers are is bench's business; that they exist is ours."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
HEADER = {"benchmark", "date", "git_hash", "versions", "machine", "options"}


def run_bench(script: str, model: Path, out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCH / script), "--model", str(model), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}" in done.stdout or out.is_file()
    report = json.loads(out.read_text())
    assert set(report) >= HEADER, sorted(HEADER - set(report))
    assert report["benchmark"] == script.removesuffix(".py")
    return report


def positive_finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_extract_pool(tiny_llama_dir, cache, tmp_path):
    r = run_bench("extract_pool.py", tiny_llama_dir, tmp_path / "ep.json", "--corpus-size", "tiny", "--concepts", "1",
                  "--batch-size", "16", "--max-length", "32", "--repeats", "1", "--naive-batches", "1",
                  "--threads", "1")
    assert r["config"]["layers"] == [0, 1] and r["config"]["hidden_size"] == 32  # the test model's 2 x 32
    assert r["config"]["n_batches"] == math.ceil(r["config"]["n_passages"] / 16)
    assert 0 < r["tokens"] <= r["config"]["n_passages"] * 32
    assert positive_finite(r["forward_tokens_per_s"], r["path_tokens_per_s"], r["path_over_forward"],
                           r["pool_share_of_forward"], r["speedup_over_naive"])
    assert set(r["targets"]) == {"path_over_forward", "pool_share_of_forward", "speedup_over_naive"}
    assert all(len(v) == 1 for v in r["repeats"].values())  # --repeats 1


def test_pool_strategies(tiny_llama_dir, cache, tmp_path):
    r = run_bench("pool_strategies.py", tiny_llama_dir, tmp_path / "ps.json", "--corpus-size", "tiny",
                  "--batch-size", "16", "--max-length", "32", "--repeats", "1", "--threads", "1")
    assert r["config"]["layers"] and set(r["config"]["layers"]) <= {0, 1}
    assert len(r["config"]["strategies"]) >= 10
    assert positive_finite(r["forward_seconds"], r["extract_over_forward"], r["pool_share_of_forward"],
                           r["parse_passages_per_s"], r["cached_parse_load_seconds"])
    assert set(r["targets"]) == {"pool_share_of_forward"}


def test_extraction_cost(tiny_llama_dir, cache, tmp_path):
    r = run_bench("extraction_cost.py", tiny_llama_dir, tmp_path / "ec.json", "--corpus-size", "tiny",
                  "--texts", "4", "--max-length", "32", "--batch-size", "4", "--repeats", "1", "--threads", "1",
                  "--stages", "raw,hidden")
    assert sorted(r["stages"]) == ["hidden", "raw"] and r["config"]["layers"] == [0, 1]
    assert r["stages"]["raw"]["over_raw"] == 1.0
    for name, stage in r["stages"].items():
        assert stage["tokens"] == r["config"]["tokens"] > 0, name
        assert positive_finite(stage["seconds"], stage["tokens_per_s"], stage["over_raw"], stage["cpu_over_raw"],
                               stage["peak_bytes"]), name


@pytest.mark.slow
def test_the_default_path_end_to_end_on_two_concepts(tmp_path):
    """`make run`'s real path (the embedded default model, corpus v2, every default but the concept list) on two
    concepts: it finishes and writes a results.json whose cells cover both concepts."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", "from poolbench.cli.app import main; main()", "run", "--out",
                           str(out), "--concepts", "hedging,toxicity"], capture_output=True, text=True, timeout=7200)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {r["concept"] for r in results["cells"]} == {"hedging", "toxicity"}
    assert results["computed"]["pooled"] + results["computed"]["pooled_skipped"] == 2
    assert all(0.0 <= r["test_auroc"] <= 1.0 for r in results["cells"])
    assert {r["concept"] for r in results.get("d2", [])} <= {"hedging", "toxicity"}
    assert (out / "leaderboard.json").is_file()


def test_d1_cost_times_an_s3_cell_beside_the_synthetic_ones(tmp_path):
    """d1_cost's synthetic cells have no S3; `--s3-heads` adds a layer's S3 cell as the driver stores it (its pooled
    row and its head table), timed on its own, and the prober keeps the head that carries the concept."""
    out = tmp_path / "d1.json"
    done = subprocess.run([sys.executable, str(BENCH / "d1_cost.py"), "--d", "64", "--n-train", "400", "--n-test",
                           "200", "--layers", "1", "--cells", "2", "--s3-heads", "4", "--threads", "1", "--out",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [layer] = json.loads(out.read_text())["per_layer"]
    assert layer["cells"] == 2 and layer["s3_heads"] == 4 and positive_finite(layer["s3_seconds"])
    assert layer["s3_heads_selected"] == [[0]] and layer["s3_cv_auroc"][0] > 0.65  # one of 4 heads kept: the first
    assert "S3's cell (4 heads)" in done.stdout
