"""Keep Serve's one hard-wired wildcard listener on the node IP when our head is loopback-only.

Ray's own servers listen on 127.0.0.1 when the node IP is 127.0.0.1, but each Serve replica opens its
inter-deployment gRPC server on `[::]:0` with no setting to change it. Peers reach it at the replica's node IP, so
binding 127.0.0.1 instead changes nothing for them. Installed as the job's `worker_process_setup_hook`.
"""

from __future__ import annotations

WILDCARDS = ("[::]:", "0.0.0.0:")


def bind_to_node_ip() -> None:
    """Wrap the helper replicas bind with, before a replica module imports it: wildcard -> 127.0.0.1."""
    from ray._common import tls_utils

    original = tls_utils.add_port_to_grpc_server
    if getattr(original, "poolbench_loopback", False):
        return

    def add_port(server, address: str):
        for wildcard in WILDCARDS:
            if address.startswith(wildcard):
                address = f"127.0.0.1:{address[len(wildcard):]}"
        return original(server, address)

    add_port.poolbench_loopback = True  # type: ignore[attr-defined]
    tls_utils.add_port_to_grpc_server = add_port
