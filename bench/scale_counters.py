"""What bench/scale.py reads from inside the driver's extractor actors: each pooling job's counts (its concepts, its
forwards, passages and tokens, and where its seconds went: the capture's forwards with their pooling launches and
S2's backward, pooling on the host, copies to the host, batch preparation), the actor's peak memory and the rows per
forward its memory model plans.

Per job, not only per actor: the run's first job holds the extractor's start (CUDA's, the kernels' first builds),
and on a GPU a later concept's forwards share the device with earlier concepts' D1 probes; a job's capture seconds
beside the raw forward over the same passages say which of the two a slow concept paid (bench/measured/
h200_session35: the driver's concept after the first pooled at 3.6x its raw forward, extraction_cost's all 19 at
2.9x).

The actor has no bench/ on its import path, so this module's functions and device_facts' travel by value
(cloudpickle), whether scale.py runs as a script or is imported by a test.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import device_facts
import torch
from device_facts import device_name, peak_bytes
from ray import cloudpickle

# Set by scale.py's SIGINT handler: an interrupted run reads nothing from its actors (Ray may be going down).
INTERRUPTED: list[bool] = []
SUMMED = ("forwards", "passages", "tokens", "padded_tokens", "forward_s", "pool_s", "device_to_host_s", "prepare_s",
          "prepared_ahead")


def install_counter(worker: object) -> None:
    """In the extractor actor: each pool_concept_group call (one pooling job) counts into an ExtractionStats of its
    own, kept with the job's concepts and wall seconds; the peak restarts."""
    import poolbench.pooler.worker as module
    from poolbench.extractor.extraction_stats import ExtractionStats

    jobs: list[dict] = []
    original = module.pool_concept_group

    def counted(loaded, members, *args, **kwargs):
        if kwargs.get("stats") is not None:
            return original(loaded, members, *args, **kwargs)
        stats = kwargs["stats"] = ExtractionStats()
        start = time.perf_counter()
        try:
            return original(loaded, members, *args, **kwargs)
        finally:
            jobs.append({"concepts": [member.concept for member in members], "wall_s": time.perf_counter() - start,
                         "forwards": stats.batches, "passages": stats.passages, "tokens": stats.tokens,
                         "padded_tokens": stats.padded_tokens, "forward_s": stats.forward_seconds,
                         "pool_s": stats.pool_seconds, "device_to_host_s": stats.transfer_seconds,
                         "prepare_s": stats.prepare_seconds, "prepared_ahead": stats.prepared_ahead,
                         **forward_spread(stats.forward_seconds_each)})

    module.pool_concept_group = counted
    worker._scale_jobs = jobs  # type: ignore[attr-defined]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def forward_spread(each: list[float]) -> dict:
    """A job's forwards one by one (`forward_s_each`) and their first, median and slowest: a one-time start (CUDA's,
    the kernels' first builds) sits in the first forwards, a cost of every forward in the median."""
    if not each:
        return {"forward_s_each": [], "first_forward_s": None, "median_forward_s": None, "slowest_forward_s": None}
    return {"forward_s_each": list(each), "first_forward_s": each[0], "median_forward_s": statistics.median(each),
            "slowest_forward_s": max(each)}


def read_counter(worker: object, layers: list[int], strategies: list[str], max_length: int) -> dict:
    """In the extractor actor: its jobs' counts summed and one by one, its peak memory, and the rows per forward its
    memory model plans."""
    from poolbench.extractor.batching import rows_per_forward
    from poolbench.extractor.capture import model_token_costs, resolve_max_batch_tokens
    from poolbench.pooler.concept_pooling import strategy_needs
    from poolbench.pooler.registry import resolve_strategies

    jobs, loaded = list(worker._scale_jobs), worker.loaded  # type: ignore[attr-defined]
    budget = resolve_max_batch_tokens(loaded.model, layers, None)
    costs = model_token_costs(loaded.model, layers, strategy_needs(resolve_strategies(strategies)))
    return {**{key: sum(job[key] for job in jobs) for key in SUMMED}, "jobs": jobs,
            "peak_bytes": peak_bytes(loaded.device),
            "peak_kind": "cuda_max_allocated" if loaded.device.type == "cuda" else "rss",
            "device_name": device_name(loaded.device), "max_batch_tokens_now": budget,
            "planned_rows_per_forward": rows_per_forward(costs, budget, max_length)}


@contextlib.contextmanager
def counted_extractors(read: Callable[[], tuple[list[int], list[str], int]], collected: list[dict]) -> Iterator[None]:
    """While open, each extractor the run starts counts its pooling, and hands its counts over before it is killed
    (the fleet's release, once the last concept is pooled); `read` gives the run's layers, strategies, max_length."""
    import ray

    import poolbench.driver.extractor_fleet as fleet
    spawner, release = fleet.extractor_spawner, fleet.ExtractorFleet.release

    def counting_spawner(*args, **kwargs):
        spawn = spawner(*args, **kwargs)

        def spawn_counted():
            actor = spawn()
            ray.get(actor.__ray_call__.remote(install_counter))
            return actor
        return spawn_counted

    def release_counted(self) -> None:
        for actor in [] if INTERRUPTED else self.actors:  # interrupted: Ray may be going down, read nothing
            try:
                collected.append(ray.get(actor.__ray_call__.remote(read_counter, *read()), timeout=60))
            except Exception as exc:  # a lost actor: its counts are lost, the run goes on
                collected.append({"error": str(exc).splitlines()[0]})
        release(self)

    fleet.extractor_spawner, fleet.ExtractorFleet.release = counting_spawner, release_counted  # type: ignore
    try:
        yield
    finally:
        fleet.extractor_spawner, fleet.ExtractorFleet.release = spawner, release  # type: ignore


def capture_by_concept(counts: list[dict], raw_s: dict[str, float]) -> dict[str, list[dict]]:
    """The jobs that pooled each concept as the extractors counted them (one, or one a pass where its layers were
    pooled in passes), each with its capture's forwards against the raw forward over its concepts' passages
    (`forward_over_raw`). A job of several concepts is each one's and names them all: its seconds are the group's,
    not split."""
    out: dict[str, list[dict]] = {}
    for extractor in counts:
        for job in extractor.get("jobs", []):
            raw = sum(raw_s.get(concept, 0.0) for concept in job["concepts"])
            entry = {**job, "forward_over_raw": job["forward_s"] / raw if raw > 0 else None}
            for concept in job["concepts"]:
                out.setdefault(concept, []).append(entry)
    return out


cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(device_facts)
