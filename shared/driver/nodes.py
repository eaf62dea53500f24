"""The Ray cluster's nodes as the driver sees them: which are alive, what each holds, how a person names one.

A lost node is told apart from a crashed worker process by asking the GCS whether the node is still alive;
a node is named `ip:port` (its raylet's address), which is what `ray status` and the raylet logs show.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle


@dataclass(frozen=True)
class Node:
    """One node of the cluster: its id, `ip:port` name, whether it is alive and its total resources."""

    node_id: str
    name: str
    alive: bool
    resources: Mapping[str, float]

    def fits(self, needs: Mapping[str, float]) -> bool:
        """Whether the node, empty, holds one actor asking for `needs` (Ray's resource names: CPU, GPU, …)."""
        return all(self.resources.get(name, 0.0) >= amount for name, amount in needs.items() if amount)


def cluster_nodes() -> list[Node]:
    """Every node the GCS knows, dead ones included (a dead node stays listed as not alive)."""
    return [Node(n["NodeID"], f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}", bool(n["Alive"]),
                 dict(n.get("Resources") or {})) for n in ray.nodes()]


def alive_nodes() -> list[Node]:
    return [node for node in cluster_nodes() if node.alive]


def resource_needs(options: Mapping[str, float]) -> dict[str, float]:
    """Ray actor options (`num_cpus`, `num_gpus`, `resources`) as the resource names nodes report."""
    needs = {"CPU": float(options.get("num_cpus", 1) or 0), "GPU": float(options.get("num_gpus", 0) or 0)}
    needs.update({k: float(v) for k, v in dict(options.get("resources") or {}).items()})  # type: ignore[arg-type]
    return {k: v for k, v in needs.items() if v}


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _pid() -> int:
    import os

    return os.getpid()


def process_id(actor: ActorHandle) -> ray.ObjectRef:
    """A ref to the actor's process id (any actor class), resolved once it has started."""
    return actor.__ray_call__.remote(lambda _self: _pid())  # type: ignore[attr-defined]


def locate(actor: ActorHandle) -> ray.ObjectRef:
    """A ref to the id of the node `actor` runs on; it resolves once the actor has started (its model loaded)."""
    return actor.__ray_call__.remote(lambda _self: _node_id())  # type: ignore[attr-defined]


def recorded_node_id(actor: ActorHandle) -> str:
    """The id of the node the GCS's actor table records for `actor`, dead or alive ("" if it never started).

    Why: a worker that exits right after a call may die before that call's reply leaves its process, so the reply of
    `locate` can fail with the actor's death; the GCS keeps a dead actor's last address. The public state API
    (`ray.util.state.get_actor`) needs the dashboard, which a driver's local Ray may not start, so the GCS table is
    read through `ray._private.state`, the accessor `ray.nodes()` uses too."""
    from ray._private import state

    info = state.actors(actor._actor_id.hex()) or {}  # type: ignore[attr-defined]
    node_id = (info.get("Address") or {}).get("NodeID", "")
    return "" if not node_id or set(node_id) <= {"0"} or set(node_id) <= {"f"} else node_id  # nil: never placed

