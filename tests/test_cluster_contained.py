"""A real cluster-up -> HTTP -> cluster-down cycle beside a foreign Ray: loopback only, the foreign one untouched.

One module-scoped pair of clusters (ours on the tiny model, a foreign `ray start --head` with auth off and its own
temp dir), all on free ports. A module fixture owns our cluster's lifetime: it brings the cluster up for any test that
asks (again, if a test took it down) and takes it down at the end, so the tests pass in any order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from ray_head import ray_head
from s3_server import free_port
from transformers import AutoModelForCausalLM, AutoTokenizer
from waiting import wait_until

from poolbench.cluster.launcher import ClusterError, cluster_down, cluster_pids, cluster_up, start_serve_app
from poolbench.cluster.processes import is_ours, members, proc_stat, stop_tree

LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]")
FOREIGN_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(host, port, pid) of every listening TCP socket of these processes, as `ss -ltnp` reports them."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        host, _, port = cols[3].rpartition(":")
        for part in cols[-1].split("pid=")[1:]:
            pid = int(part.split(",")[0])
            if pid in pids:
                found.append((host, int(port), pid))
    return found


def foreign_driver(address: str, code: str) -> str:
    """Run `code` in a driver connected to the foreign Ray (auth off, as it was started); returns its stdout."""
    script = f"import ray; ray.init(address={address!r}, logging_level='ERROR'); {code}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **FOREIGN_ENV})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def foreign() -> Iterator[dict]:
    """Someone else's Ray on this machine: started first, so a cluster-up that said `auto` would find it."""
    with ray_head("pb-foreign-", 1, {**os.environ, **FOREIGN_ENV}) as head:
        record = {"pid": head.process.pid, "start_ticks": head.start_ticks, "address": head.address}
        assert foreign_driver(record["address"], "print(ray.get(ray.remote(lambda: 6 * 7).remote()))") == "42\n"
        yield record


class OurCluster:
    """Our cluster, brought up on demand and taken down through `down()` (by a test) or at the module's end."""

    def __init__(self, models: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.models, self.tmp = models, tmp_path_factory
        self.info: dict | None = None

    def up(self) -> dict:
        if self.info is None:
            state = self.tmp.mktemp("cluster") / "state"
            info = cluster_up(ray_port=free_port(), serve_port=free_port(), state=state, store="",
                              models=self.models, num_cpus=2)
            self.info = {**info, "state": state}
        return self.info

    def down(self) -> list[str]:
        state, self.info = self.info["state"], None
        return cluster_down(state)


@pytest.fixture(scope="module")
def cluster(foreign, tiny_llama_dir, tmp_path_factory) -> Iterator[OurCluster]:
    owner = OurCluster([str(tiny_llama_dir)], tmp_path_factory)
    try:
        yield owner
    finally:
        if owner.info is not None:
            owner.down()


@pytest.fixture
def ours(cluster: OurCluster) -> dict:
    return cluster.up()


def test_the_app_answers_from_our_head(ours, tiny_llama_dir):
    assert ours["ray_address"].startswith("127.0.0.1:") and ours["serve_url"].startswith("http://127.0.0.1:")
    health = httpx.get(f"{ours['serve_url']}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["models"] == [str(tiny_llama_dir)]
    texts = ["the cat sat on the mat", "perhaps it rains"]
    reply = httpx.post(f"{ours['serve_url']}/pool", timeout=120,
                       json={"model": str(tiny_llama_dir), "layer": 0, "strategy": "A1", "texts": texts})
    assert reply.status_code == 200, reply.text
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    for text, vector in zip(texts, reply.json()["vectors"], strict=True):
        with torch.no_grad():
            hidden = lm(**tok(text, return_tensors="pt"), output_hidden_states=True).hidden_states[1][0]
        np.testing.assert_allclose(vector, hidden.mean(0).numpy(), atol=1e-4)


def test_everything_we_started_listens_on_loopback_only(ours):
    pids = set(cluster_pids(ours["state"]))
    found = listeners(pids)
    ports = {port for _, port, _ in found}
    ray_port, serve_port = int(ours["ray_address"].rpartition(":")[2]), int(ours["serve_url"].rpartition(":")[2])
    # The head, Serve's proxy and Ray's side servers are all among them: the check sees the real sockets.
    assert {ray_port, serve_port} <= ports and len(found) >= 8, found
    assert [(host, port) for host, port, _ in found if host not in LOOPBACK] == []


def test_deploy_refuses_a_head_it_did_not_start(ours, foreign, tiny_llama_dir):
    # Same cluster id and token, the foreign head's address: its nodes lack our label, so nothing is deployed.
    wrong = {**ours, "ray_address": foreign["address"]}
    with pytest.raises(ClusterError, match=r"refusing: the Ray at 127\.0\.0\.1:\d+ was not started by this cluster"):
        start_serve_app(wrong, [str(tiny_llama_dir)], "127.0.0.1", free_port())


def test_down_stops_exactly_ours_and_the_foreign_ray_is_untouched(cluster, ours, foreign):
    state = ours["state"]
    pids = cluster_pids(state)
    assert len(pids) >= 6 and foreign["pid"] not in pids
    stopped = cluster.down()
    assert stopped[0].startswith(f"serve app on {ours['serve_url']} (")
    # "graceful": every process left on SIGTERM within the grace period, none needed SIGKILL.
    assert stopped[1].startswith(f"ray head {ours['ray_address']} (pid ") and ", graceful, " in stopped[1]
    assert len(stopped) == 2, stopped
    assert [pid for pid in pids if proc_stat(pid) is not None] == []
    assert sorted(p.name for p in state.iterdir()) == ["ray.log"] and not Path(ours["ray_temp_dir"]).exists()
    assert cluster_down(state) == []
    # The foreign Ray: same process, still answering, and nothing of ours ever reached it.
    assert is_ours(foreign["pid"], foreign["start_ticks"])
    actors = json.loads(foreign_driver(foreign["address"], "import json; print(json.dumps(["
                                       "ray.util.list_named_actors(all_namespaces=True), "
                                       "ray.get(ray.remote(lambda: 6 * 7).remote())]))"))
    assert actors == [[], 42]


def test_stop_tree_signals_the_leader_only_and_spares_a_reused_pid(tmp_path):
    # A leader that stops its own children on SIGTERM, as `ray start --block` does; it says when its trap is set.
    ready = tmp_path / "ready"
    proc = subprocess.Popen(["sh", "-c", 'sleep 60 & a=$!; sleep 60 & b=$!; trap "kill $a $b; exit 0" TERM; '
                             f'touch {ready}; wait'], start_new_session=True)
    wait_until(ready.exists, "the leader to set its trap")
    ticks = proc_stat(proc.pid).start_ticks
    children = sorted(pid for pid in members(proc.pid) if pid != proc.pid)
    assert len(children) == 2
    assert stop_tree(proc.pid, ticks + 1) == (0, True)  # another start time: another process, never signalled
    assert proc.poll() is None
    assert stop_tree(proc.pid, ticks) == (3, True)
    assert proc.wait(timeout=5) == 0  # its trap ran: it was asked, not killed
    assert [pid for pid in children if proc_stat(pid) is not None] == []


def test_stop_tree_kills_what_outlives_the_grace_period():
    # The shell loops, so killing its sleep first never lets it exit on its own: only SIGKILL ends it.
    proc = subprocess.Popen(["sh", "-c", 'trap "" TERM; while :; do sleep 60 & wait; done'], start_new_session=True)

    def shell_and_sleep() -> dict[int, int] | None:  # the sleep runs only after the trap is set
        tree = members(proc.pid)
        return tree if len(tree) == 2 else None

    tree = wait_until(shell_and_sleep, "the looping shell and its sleep")
    # Not graceful: both outlived the grace period and were SIGKILLed (stop_tree reaps the leader itself, so its
    # exit status is not Popen's to read).
    assert stop_tree(proc.pid, proc_stat(proc.pid).start_ticks, grace_s=1.0) == (2, False)
    proc.wait(timeout=5)
    # SIGKILL is delivered asynchronously: wait for the kernel to end both, failing only past the deadline.
    wait_until(lambda: not [pid for pid in tree if proc_stat(pid) is not None], "the SIGKILLed shell and sleep to end")
