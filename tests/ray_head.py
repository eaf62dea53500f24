"""A Ray head of a test's own on loopback, free ports and its own temp dir, stopped by its process tree alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from s3_server import free_port

from poolbench.cluster.processes import proc_stat, stop_tree

RAY = str(Path(sys.executable).with_name("ray"))
SIDE_PORTS = ("ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port")


@dataclass(frozen=True)
class RayHead:
    process: subprocess.Popen
    port: int
    start_ticks: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def ray_head(prefix: str, num_cpus: int, env: dict[str, str]) -> Iterator[RayHead]:
    """`ray start --head --block` on free ports; on exit only its own process tree is stopped (never `ray stop`)."""
    port, temp_dir = free_port(), tempfile.mkdtemp(prefix=prefix)
    side = [f"--{flag}={free_port()}" for flag in SIDE_PORTS]
    process = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
                                "--disable-usage-stats", "--block", *side], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    head = RayHead(process, port, proc_stat(process.pid).start_ticks)
    try:
        yield head
    finally:
        stop_tree(process.pid, head.start_ticks)
        process.wait(timeout=30)
        shutil.rmtree(temp_dir, ignore_errors=True)
