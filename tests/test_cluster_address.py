"""`run --address auto` on a `ray start` head gives the same cells as a private local run (starts a head: slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).with_name("ray"))


def run(args: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-c", "from poolbench.cli.app import main; main()", "run", "--no-steering", *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_address_auto_matches_local_mode(tiny_llama_dir, tmp_path):
    env = {**os.environ, "POOLBENCH_CACHE": str(tmp_path / "cache")}
    common = ["--model", str(tiny_llama_dir), "--corpus-size", "tiny", "--concepts", "hedging,toxicity",
              "--strategies", "A1,P1", "--bootstrap", "200"]
    local = run([*common, "--store", str(tmp_path / "local"), "--out", str(tmp_path / "out-local")], env)
    subprocess.run([RAY, "start", "--head", "--port", "6397", "--num-cpus", "2", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=120)
    try:
        clustered = run([*common, "--address", "auto", "--store", str(tmp_path / "cluster"),
                         "--out", str(tmp_path / "out-cluster")], env)
    finally:
        subprocess.run([RAY, "stop"], env=env, capture_output=True, timeout=120)
    assert clustered["config"]["address"] == "auto"
    assert clustered["cells"] == local["cells"]
