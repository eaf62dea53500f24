"""A short-lived Ray driver for cluster-up/down: connect to OUR head only, then deploy or shut down the Serve app.

It runs in its own process (`python -m poolbench.cluster.session deploy|shutdown JSON`) with the environment
`ray_env` gives, so the caller never holds a Ray connection. It connects to the explicit address recorded in the
cluster folder, never `auto`, and refuses a Ray whose head does not carry this folder's cluster id as a node label.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from poolbench.errors import PoolBenchError

CLUSTER_LABEL = "poolbench-cluster-id"


class ForeignClusterError(PoolBenchError):
    """The Ray at the recorded address is not the one this cluster folder started."""


def ray_env(token_path: Path, node_ip: str) -> dict[str, str]:
    """What every process of our cluster, and every driver joining it, needs in its environment.

    Token auth with our own token: a `~/.ray/auth_token` makes `ray start` turn auth on by itself while an explicit
    address does not, which is why connecting failed with InvalidAuthToken; saying the mode and the token file
    outright makes head and drivers agree. On a loopback node IP, Ray's "no multi-node cluster" mode keeps
    `127.0.0.1` as the node IP (otherwise Ray swaps in the machine's address), and Ray's servers listen on
    127.0.0.1 only when the node IP is 127.0.0.1. The drain on SIGTERM is bounded: cluster-down stops Serve first.
    """
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path.resolve()),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "3"}
    if node_ip in ("127.0.0.1", "localhost", "::1"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def connect(address: str, cluster_id: str) -> None:
    """ray.init on the explicit address, then check the head is ours (its node label carries our cluster id)."""
    import ray

    loopback = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    runtime_env = {"worker_process_setup_hook": "poolbench.cluster.loopback.bind_to_node_ip"} if loopback else None
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env=runtime_env)
    except (ConnectionError, RuntimeError) as exc:
        raise PoolBenchError(f"the Ray head at {address} does not answer: {str(exc).splitlines()[0][:160]}") from exc
    labels = [node.get("Labels", {}).get(CLUSTER_LABEL) for node in ray.nodes() if node.get("Alive")]
    if cluster_id not in labels:
        ray.shutdown()
        raise ForeignClusterError(f"refusing: the Ray at {address} was not started by this cluster folder "
                                  f"(cluster id {cluster_id} not among its nodes)")


def deploy(args: dict) -> str:
    from poolbench.http.app import start_serve
    from poolbench.http.settings import ServiceSettings

    connect(args["address"], args["cluster_id"])
    return start_serve(ServiceSettings(**args["settings"]), host=args["host"], port=args["port"])


def shutdown(args: dict) -> str:
    from ray import serve

    connect(args["address"], args["cluster_id"])
    serve.shutdown()
    return "serve shut down"


def main(argv: list[str]) -> int:
    action, payload = argv
    try:
        print({"deploy": deploy, "shutdown": shutdown}[action](json.loads(payload)), flush=True)
    except PoolBenchError as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
