"""The private Ray a plain `run` starts: loopback only, no dashboard, its own temp folder in PoolBench's cache.

Ray listens on every interface and shares the machine-wide /tmp/ray unless told otherwise; these are the settings
that keep a single-machine run to itself (the same ones `cluster up` gives its head, see poolbench.cluster.session).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from poolbench.defaults import cache_dir

LOOPBACK = "127.0.0.1"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_RUNTIME_ENV = {"worker_process_setup_hook": "poolbench.cluster.loopback.bind_to_node_ip"}
"""For a local Ray that serves HTTP: Serve replicas' one wildcard gRPC listener bound to 127.0.0.1 instead."""
MAX_TEMP_DIR_CHARS = 40  # Ray appends up to ~65 characters of session and socket names; a socket path: 107 bytes


def local_temp_dir() -> Path:
    """`<cache>/ray`, or a private short folder when the cache path is too long for Ray's socket names."""
    folder = cache_dir() / "ray"
    if len(str(folder)) > MAX_TEMP_DIR_CHARS:
        return Path(tempfile.mkdtemp(prefix="pb-ray-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def init_local_ray(**options: Any) -> Path:
    """ray.init a new private local Ray on 127.0.0.1 with no dashboard; returns its temp folder."""
    # On a loopback node IP Ray keeps 127.0.0.1 (instead of swapping in the machine's address) in its single-machine
    # mode, and its servers then listen on 127.0.0.1 only. The raylet and GCS inherit the variable; this process read
    # it when it imported ray, so the constant it derived is set as well.
    os.environ[SINGLE_MACHINE_ENV] = "0"
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    temp_dir = local_temp_dir()
    ray.init(address="local", _node_ip_address=LOOPBACK, _temp_dir=str(temp_dir), include_dashboard=False,
             **{"logging_level": "ERROR", "log_to_driver": False, **options})
    return temp_dir
