"""A Ray cluster of a test's own on loopback: a head and worker nodes (ray.cluster_utils.Cluster), every node on
127.0.0.1 with free ports and its own short temp folder, so a node can be removed without grace mid-run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray._private import ray_constants
from ray.cluster_utils import Cluster
from s3_server import free_port

from poolbench.driver.local_ray import LOOPBACK, SINGLE_MACHINE_ENV

FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                      "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
"""A node that stops answering is declared dead in ~1.5 s instead of Ray's default ~30 s."""


def _ports() -> dict:
    return {"runtime_env_agent_port": free_port(), "metrics_export_port": free_port(),
            "dashboard_agent_listen_port": free_port(), "min_worker_port": 0, "max_worker_port": 0}


@contextmanager
def loopback_cluster(*nodes: dict, head_cpus: int = 0) -> Iterator[tuple[Cluster, list]]:
    """A head holding `head_cpus` CPUs (the driver's scorers and nothing else by default) and one worker node per
    `nodes` entry (add_node's arguments: num_cpus, num_gpus, resources); the driver is not connected."""
    ray.shutdown()  # the driver joins this cluster, not a local Ray an earlier test left (local_ray restarts one)
    previous = os.environ.get(SINGLE_MACHINE_ENV)
    os.environ[SINGLE_MACHINE_ENV] = "0"  # Ray keeps 127.0.0.1 instead of the machine's address
    ray_constants.ENABLE_RAY_CLUSTER = False
    temp_dir = tempfile.mkdtemp(prefix="pb-cl-")  # short: Ray's socket paths must fit in 107 bytes
    common = {"node_ip_address": LOOPBACK, "temp_dir": temp_dir, "object_store_memory": 80 * 1024 * 1024}
    # Never point other Ray users' `address="auto"` at this cluster, nor delete the file naming theirs.
    write_address, reset_address = ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address
    ray._private.utils.write_ray_address = lambda *_: None
    ray._common.utils.reset_ray_address = lambda *_: None
    cluster = Cluster()
    try:
        cluster.add_node(**common, **_ports(), num_cpus=head_cpus, gcs_server_port=free_port(), include_dashboard=False,
                         ray_client_server_port=free_port(), _system_config=FAST_HEALTH_CHECKS)
        workers = [add_loopback_node(cluster, **node) for node in nodes]
        cluster.wait_for_nodes()
        yield cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()
        ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address = write_address, reset_address
        if previous is None:
            os.environ.pop(SINGLE_MACHINE_ENV, None)
        else:
            os.environ[SINGLE_MACHINE_ENV] = previous
        shutil.rmtree(temp_dir, ignore_errors=True)


def add_loopback_node(cluster: Cluster, **node):
    """One more worker node on 127.0.0.1 in the head's temp folder, on free ports (add_node's arguments)."""
    temp_dir = cluster.head_node._ray_params.temp_dir  # type: ignore[union-attr]
    return cluster.add_node(node_ip_address=LOOPBACK, temp_dir=temp_dir, object_store_memory=80 * 1024 * 1024,
                            **_ports(), **node)


def node_name(node) -> str:
    """How the driver names a node (`ip:port` of its raylet)."""
    return f"{node.node_ip_address}:{node.node_manager_port}"


@contextmanager
def reported_gpus_ray(num_cpus: int, num_gpus: int) -> Iterator[None]:
    """A private local Ray that reports `num_gpus` GPUs (Ray counts them and sets CUDA_VISIBLE_DEVICES per task;
    torch sees none, so every tensor stays on the CPU); another module's Ray is stopped first, and conftest's
    local_ray starts its own again for the modules after. The GPU plan leaves an extractor's CPU threads alone (a
    GPU's forward is not theirs): one OpenMP thread, as Ray gives a one-CPU actor, whatever this process's
    environment says, so a GPU-shaped run and a CPU run both compute on one thread."""
    from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray

    if ray.is_initialized():
        ray.shutdown()
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        init_local_ray(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=LOOPBACK_RUNTIME_ENV)
        yield
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
