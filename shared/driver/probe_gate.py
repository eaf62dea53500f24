"""When a run's probe tasks may start: beside the pooling where the forward runs on a GPU (the host's cores are idle
while it computes), only after it where the forward runs on the same CPU cores.

Why: on CPU the extractor's forward and backward are matrix products split across an OpenMP team of every core; a
probe task beside it takes whole time slices from one member, and the rest of the team waits at the next barrier,
so the forward loses more than the probe's CPU time (bench/README.md, "`make run` on a 2-core AMD EPYC with
AVX-512").
The held jobs are released in the order they came, the moment the last pooling job is done; `on_pooled` runs then
(the run's extractors leave, so the probes get their cores too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from poolbench.config import RunConfig, resolve_overlap

from .extractor_fleet import probes_per_gpu

J = TypeVar("J")


def beside_the_forward(cfg: RunConfig, on_gpu: bool) -> bool:
    """Whether host work (parse tasks ahead, probe tasks) runs beside the pooling forward: on a GPU unless
    --no-overlap, on CPU only with --overlap (it then shares the forward's cores)."""
    return resolve_overlap(cfg.overlap, on_gpu)


def probes_beside(cfg: RunConfig, on_gpu: bool) -> bool:
    """Whether probe tasks start beside the pooling: where host work does (beside_the_forward), unless a GPU run
    is told to run none beside its extractors ($POOLBENCH_PROBES_PER_GPU=0): its probes on the GPU time-slice it
    with the forward, which they may slow more than they gain."""
    return beside_the_forward(cfg, on_gpu) and not (on_gpu and probes_per_gpu() == 0)


@dataclass
class ProbeGate(Generic[J]):
    """Holds probe jobs while pooling jobs are outstanding, unless `beside` says they may run alongside."""

    beside: bool
    on_pooled: Callable[[], None] | None = None  # called once, when the last pooling job is done
    pools_left: int = 0
    held: list[J] = field(default_factory=list)

    def start(self, pools: int, jobs: Iterable[J]) -> list[J]:
        """The run's pooling job count, and the probe jobs known before any (concepts pooled by an earlier run):
        those that may start now."""
        self.pools_left = pools
        now = self._admit(jobs)
        if pools <= 0:
            self._done()
        return now

    def pooled(self, jobs: Iterable[J]) -> list[J]:
        """A pooling job is done: its concepts' probe jobs, and every held one once it was the last."""
        self.pools_left -= 1
        now = self._admit(jobs)
        if self.pools_left <= 0:
            now, self.held = [*self.held, *now], []
            self._done()
        return now

    def flush(self) -> list[J]:
        """The held jobs, now, while the pooling waits for room in the store (--drop-pooled, room_gate.py): the
        concepts pooled so far must be probed for their vectors to leave. `on_pooled` still waits for the last
        pooling job, and the probes of pooling still to come are held again."""
        now, self.held = self.held, []
        return now

    def _admit(self, jobs: Iterable[J]) -> list[J]:
        if self.beside or self.pools_left <= 0:
            return list(jobs)
        self.held.extend(jobs)
        return []

    def _done(self) -> None:
        if self.on_pooled is not None:
            self.on_pooled()
            self.on_pooled = None
