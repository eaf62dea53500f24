"""`run --address auto` on a `ray start` head gives the same cells as a private local run (starts a head: slow).

The head is this test's own: free ports, its own temp dir, `auto` pointed at it through RAY_ADDRESS (so another
Ray on the machine is never picked up), and only its process tree is stopped afterwards (no bare `ray stop`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray_head import ray_head


def run(args: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-c", "from poolbench.cli.app import main; main()", "run", "--no-steering", *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "results.json").read_text())


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the head's GCS accepts connections (or the head exited, or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the Ray head did not listen on 127.0.0.1:{port} within {timeout_s} s")


@pytest.mark.slow
def test_address_auto_matches_local_mode(tiny_llama_dir, tmp_path):
    # Auth off for head and driver alike: with ~/.ray/auth_token present Ray switches token auth on by itself.
    env = {**os.environ, "POOLBENCH_CACHE": str(tmp_path / "cache"), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    common = ["--model", str(tiny_llama_dir), "--corpus-size", "tiny", "--concepts", "hedging,toxicity",
              "--strategies", "A1,P1", "--n-bootstrap", "200"]
    local = run([*common, "--store", str(tmp_path / "local"), "--out", str(tmp_path / "out-local")], env)
    with ray_head("pb-address-", 2, env) as head:
        wait_for_port(head.port, head.process)
        clustered = run([*common, "--address", "auto", "--store", str(tmp_path / "cluster"),
                         "--out", str(tmp_path / "out-cluster")], {**env, "RAY_ADDRESS": head.address})
    assert clustered["config"]["address"] == "auto"
    assert clustered["cells"] == local["cells"]
