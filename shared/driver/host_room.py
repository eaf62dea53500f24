"""Room in the extractor host's memory for its pooling jobs, planned before the first forward.

A pooling job holds its concepts' pooled vectors on the host until it writes them (float32, whatever the store's
dtype), and while writing, what its writers encode and serialise beside them; a GPU extractor holds two jobs at once
(extractor_fleet.JOB_SLOTS_GPU: the next job's forwards run while this one's shards are written). At the full
corpus an 8B model's concept is ~10 GB at 6 layers, ~55 GB at all 32 (S3's per-head vectors are most of it): two
such jobs with their copies are more than many a GPU machine's host memory, and the kernel would kill the extractor
an hour into the run. So the plan is fitted to the memory available to each extractor (its host's, shared by the
extractors on that host), cheapest step first: (1) a group of concepts sharing forwards is cut into single
concepts; (2) an extractor holds one job instead of two; (3) a concept is pooled in passes over its layers, each
pass its own forwards (the forward repeated: slower, never killed), its manifest written by the driver after the
last. A concept of which one layer alone does not fit stops the run with one line. The bytes are the vectors'
payload (stored_size) plus what the write path's copies can add to them (VectorBytes; measured too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolbench.byte_size import size
from poolbench.errors import PoolBenchError

from .run_plan import PoolGroup

HOST_SHARE = 0.8  # of an extractor's available memory its jobs may hold: the rest is Ray's, D1 tasks', Arrow's

JOB_FIXED = 1 << 27  # what a job holds whatever its size (Arrow's pool, the writers' threads): ~0.04-0.15 GB


@dataclass(frozen=True)
class VectorBytes:
    """A passage's pooled vectors at one layer as a job holds them until written (`held`: float32, whatever the
    store's dtype) and what its writers add beside them at most (`copied`, counted from the write path by
    stored_size.write_copy_bytes_per_passage_layer): each layer's tables own their memory and a writer lets go of
    a layer's float32 tables as it encodes them, so a job peaks at its vectors plus its writers' copies, not every
    layer encoded beside them. Measured against the count: bench/shard_writes.py --memory (bench/README.md)."""

    held: int
    copied: int
    fixed: int = JOB_FIXED

    def peak(self, rows: int) -> int:
        """What a job of `rows` (passage, layer) rows holds at its peak, while it writes."""
        return (self.held + self.copied) * rows + self.fixed

    def job(self, group: PoolGroup) -> int:
        return self.peak(sum(len(plan.passages) * len(layers) for plan, layers in group))


@dataclass(frozen=True)
class HostPlan:
    """The pooling jobs and how many an extractor holds at once, fitted to `budget` bytes an extractor; `passes`:
    the concepts pooled over their layers in several jobs (the driver writes their manifests); `steps`: what was
    cut, in words, for the run's log (empty when the plan was left as it was)."""

    groups: list[PoolGroup]
    slots: int
    budget: int
    passes: dict[str, int]
    steps: tuple[str, ...] = ()


def extractor_budget(rooms: Sequence[dict]) -> int:
    """The bytes each extractor's jobs may hold: HOST_SHARE of its host's available memory, shared by the
    extractors on that host (`rooms`: each extractor's {"host", "available"}); the smallest such share."""
    per_host: dict[str, list[int]] = {}
    for room in rooms:
        per_host.setdefault(str(room["host"]), []).append(int(room["available"]))
    return min(int(HOST_SHARE * min(available) / len(available)) for available in per_host.values())


def fit_host_room(groups: list[PoolGroup], bytes_per: VectorBytes, budget: int, slots: int) -> HostPlan:
    """The groups and job slots that keep every extractor's jobs within `budget` (see the module's docstring)."""
    steps: list[str] = []

    def fits(plan_groups: list[PoolGroup], n_slots: int) -> bool:
        return all(n_slots * bytes_per.job(group) <= budget for group in plan_groups)

    if fits(groups, slots):
        return HostPlan(groups, slots, budget, {})
    singles = [[member] for group in groups for member in group] if any(len(g) > 1 for g in groups) else groups
    if singles is not groups:
        steps.append("concepts sharing forwards pooled one a job")
        if fits(singles, slots):
            return HostPlan(singles, slots, budget, {}, tuple(steps))
    if slots > 1:
        steps.append("one job an extractor at a time instead of two")
        slots = 1
        if fits(singles, slots):
            return HostPlan(singles, slots, budget, {}, tuple(steps))
    planned: list[PoolGroup] = []
    passes: dict[str, int] = {}
    for [(plan, layers)] in singles:
        per_layer = bytes_per.job([(plan, [0])])
        if per_layer > budget:
            raise PoolBenchError(
                f"concept {plan.concept}: one layer's pooled vectors ({len(plan.passages)} passages) need at least "
                f"{size(per_layer)} of host memory while written, and an extractor has {size(budget)} "
                "(HOST_SHARE of its host's available memory): use fewer strategies (S3's per-head vectors are "
                "most of it), a smaller --corpus-size, or a host with more memory")
        if per_layer * len(layers) <= budget:
            planned.append([(plan, layers)])
            continue
        at_once = max(1, budget // per_layer)
        chunks = [layers[i:i + at_once] for i in range(0, len(layers), at_once)]
        planned.extend([(plan, chunk)] for chunk in chunks)
        passes[plan.concept] = len(chunks)
    steps.append(f"{len(passes)} concept(s) pooled in passes over their layers (the forward repeated a pass)")
    return HostPlan(planned, slots, budget, passes, tuple(steps))
