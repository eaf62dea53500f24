"""ClusterActivity: where a run's jobs ran, which nodes it lost and which jobs it ran again, for results.json."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from poolbench.records.events import JobRetried


@dataclass(frozen=True)
class ClusterActivity:
    """Per stage (`pool`, `steer`): jobs finished per node (`ip:port`); the run's lost nodes and retried jobs."""

    jobs_by_node: dict[str, dict[str, int]] = field(default_factory=dict)
    lost_nodes: tuple[str, ...] = ()
    retried: tuple[JobRetried, ...] = ()

    def merged(self, stage: str, done_on: Counter[str], lost_nodes: list[str],
               retried: list[JobRetried]) -> ClusterActivity:
        """This record with one more stage's work queue added."""
        return ClusterActivity({**self.jobs_by_node, stage: dict(sorted(done_on.items()))},
                               tuple(dict.fromkeys([*self.lost_nodes, *lost_nodes])), (*self.retried, *retried))

    def joined(self, other: ClusterActivity) -> ClusterActivity:
        """Both records' stages, lost nodes and retries (a run's D1 stage, then its steering stage)."""
        return ClusterActivity({**self.jobs_by_node, **other.jobs_by_node},
                               tuple(dict.fromkeys([*self.lost_nodes, *other.lost_nodes])),
                               (*self.retried, *other.retried))

    def to_dict(self) -> dict:
        return {"jobs_by_node": self.jobs_by_node, "lost_nodes": list(self.lost_nodes),
                "retried": [r.to_dict() for r in self.retried]}
