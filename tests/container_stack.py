"""The deploy/ compose stack under podman, for tests/test_containers.py: podman with the project's containers.conf,
podman-compose over the operator's file, the local override and a test file of the test's own (its model, plugin and
run folders mounted, threads pinned), and what a stack leaves behind once it is down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("POOLBENCH_IMAGE", "poolbench/poolbench:cpu")
COMPOSE_FILES = (ROOT / "deploy" / "docker-compose.yml", ROOT / "deploy" / "docker-compose.local.yml")
PROJECT_LABEL = "io.podman.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
# One thread everywhere, in every container and in the single-process run: cells compare bit for bit.
PINNED_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def engine_env(**extra: str) -> dict[str, str]:
    """The environment podman runs under: the project's containers.conf unless CONTAINERS_CONF names another."""
    conf = os.environ.get("CONTAINERS_CONF") or str(ROOT / "deploy" / "containers.conf")
    return {**os.environ, "CONTAINERS_CONF": conf, **extra}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], env=engine_env(), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} … exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return done


def volumes() -> set[str]:
    return set(podman("volume", "ls", "-q").stdout.split())


def networks() -> set[str]:
    return set(podman("network", "ls", "--format", "{{.Name}}").stdout.split())


def wait_until(what: str, ready: Callable[[], bool], timeout_s: float, every_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def compose_layer(assets: Path) -> dict:
    """The test's own layer over the override: the model and plugin read-only at /assets, the workers' signal folder
    (which node holds a slow job), the driver's run folder, and the pinned thread counts."""
    shared = [f"{assets / 'shared'}:/assets:ro"]
    return {"services": {
        "ray-head": {"environment": dict(PINNED_THREADS), "volumes": shared},
        "ray-worker": {"environment": dict(PINNED_THREADS), "volumes": [*shared, f"{assets / 'signals'}:/signals"]},
        "driver": {"environment": dict(PINNED_THREADS), "volumes": [*shared, f"{assets / 'runs'}:/runs"]},
    }}


class ComposeStack:
    """One podman-compose project (its own name, so its network and volumes are its own)."""

    def __init__(self, project: str, test_file: Path, token: str) -> None:
        self.project = project
        self.files = (*COMPOSE_FILES, test_file)
        self.env = engine_env(POOLBENCH_TOKEN=token)
        self.volumes_before, self.networks_before = volumes(), networks()  # what down must return to

    def argv(self, *args: str) -> list[str]:
        compose = Path(sys.executable).with_name("podman-compose")
        files = [w for f in self.files for w in ("-f", str(f))]
        return [str(compose), "-p", self.project, *files, *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args[:4])} exited {done.returncode}: "
                                 f"{(done.stdout + done.stderr).strip()[-1500:]}")
        return done

    def popen(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as out:
            return subprocess.Popen(self.argv(*args), env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def containers(self) -> dict[str, str]:
        """Every container of the project, running or not: name -> compose service."""
        listed = podman("ps", "-a", "--filter", f"label={PROJECT_LABEL}={self.project}", "--format", "json").stdout
        return {c["Names"][0]: c["Labels"].get(SERVICE_LABEL, "") for c in json.loads(listed or "[]")}

    def container_of(self, service: str) -> list[str]:
        return sorted(name for name, svc in self.containers().items() if svc == service)

    def ip_of(self, container: str) -> str:
        nets = json.loads(podman("inspect", container, "--format", "{{json .NetworkSettings.Networks}}").stdout)
        [net] = nets.values()
        return net["IPAddress"]

    def exec(self, container: str, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return podman("exec", container, *argv, timeout=timeout, check=check)

    def alive_ray_nodes(self, head: str) -> int:
        """Nodes `ray status` lists as active (the head included); 0 while the head does not answer."""
        done = self.exec(head, "ray", "status", "--address", "ray-head:6379", check=False, timeout=60)
        if done.returncode != 0:
            return 0
        active = done.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return sum(1 for line in active.splitlines() if "node_" in line)

    def logs(self) -> str:
        """The last lines of every container's log, for a failure message."""
        out = []
        for name in self.containers():
            done = podman("logs", "--tail", "15", name, check=False)
            out.append(f"--- {name}\n{(done.stdout + done.stderr).strip()}")
        return "\n".join(out)

    def down(self) -> None:
        self.compose("down", "-v", "-t", "5", timeout=300, check=False)
