"""The private Ray a plain run starts listens on loopback only and keeps its files in PoolBench's cache."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import psutil
import pytest


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also as an IPv4-mapped IPv6 address (::ffff:127.0.0.1), which Ray's gRPC servers use."""
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def listening_addresses(pids: set[int]) -> set[tuple[str, int, int]]:
    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found |= {(c.laddr.ip, c.laddr.port, pid) for c in connections if c.status == psutil.CONN_LISTEN}
    return found


@pytest.mark.slow
def test_run_ray_listens_on_loopback_only_with_its_own_temp_folder(monkeypatch: pytest.MonkeyPatch):
    import shutil
    import tempfile

    import ray

    from poolbench.driver.pipeline import connect_ray

    cache = Path(tempfile.mkdtemp(prefix="pbc"))  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setenv("POOLBENCH_CACHE", str(cache))
    assert not ray.is_initialized()
    connect_ray(None)
    try:
        ray.get(ray.remote(lambda: 1).remote())  # a worker process is up too
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        pids = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)} | {os.getpid()}
        listening = listening_addresses(pids)
        node_ip = {node["NodeManagerAddress"] for node in ray.nodes()}
    finally:
        ray.shutdown()
        shutil.rmtree(cache, ignore_errors=True)
    assert session.parent == cache / "ray"  # not /tmp/ray
    assert node_ip == {"127.0.0.1"}
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("::ffff:192.0.2.2")
    assert len(listening) >= 3  # GCS, raylet, object manager at least
    assert {ip for ip, _, _ in listening if not is_loopback(ip)} == set(), listening
