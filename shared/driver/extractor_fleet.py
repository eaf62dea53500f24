"""The extractor actors of a run: started for its first model and, in a run over several models, kept for the next.

Each worker loads a model once and pools every concept it is handed with it; the next model replaces it in the same
processes (`ExtractorWorker.switch_model` frees the old one first), so models that do not fit together run one
after another on the same workers and the run pays for Ray actors, imports and plugins once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence

import ray
from ray.actor import ActorHandle

from poolbench.compute_thread import with_compute_thread
from poolbench.config import RunConfig
from poolbench.errors import PoolBenchError
from poolbench.pooler.worker import ExtractorWorker
from poolbench.records.events import EventSink

from .nodes import alive_nodes, resource_needs
from .work_queue import WorkerLost, WorkQueue, fetch

FORWARDED_ENV = ("POOLBENCH_CACHE", "POOLBENCH_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_REGION", "HF_HOME", "HF_HUB_OFFLINE")


def worker_runtime_env() -> dict:
    """The store's endpoint and credentials (and the cache) as the driver sees them now, for every worker."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    return {"env_vars": env} if env else {}


# On a GPU the extractor holds most of its GPU and D1's batched probe tasks share the rest (2 at once beside one
# extractor, 8 on a GPU of their own once the pooling is done); over half, so Ray never packs two extractors onto one
# GPU. Ray counts shares, not memory: a task probes a layer's cells in one batch (batched_cell.CELLS_PER_CALL_CUDA),
# ~7 GB of float64 tensors at the full corpus's n = 1,400, d = 4,096 (counted from the shapes, not measured), so 8
# of them hold ~56 of an H100's 80 GB, 2 beside an extractor's ≤ 50 GB ~64. Why
# not more: one process's batch is a few launches per Newton step for all its cells; with one cell a call (before),
# 4, 8 and 16 processes on an H100 probed 3.3, 3.6 and 3.6 cells/s (bench/measured/h100_session20).
EXTRACTOR_GPU_SHARE = 0.75
PROBE_GPU_SHARE = 0.125
# How many probe tasks run beside one extractor: processes time-slice a GPU (no two run kernels at once without
# MPS), so more of them fill each other's host gaps but slow the forward beside them (measured on an H200,
# bench/measured/h200_warm: 15.0 s a concept's pooling with ~4 beside, 10.7 s with fewer). A tuning knob, never a
# result: the records do not depend on it.
PROBES_PER_GPU_ENV = "POOLBENCH_PROBES_PER_GPU"
# Pooling jobs a GPU extractor holds at once: the second one's forwards run while the first one's shards are written
# (~10 GB a concept at the full corpus and d 4,096, seconds of host work with the GPU idle otherwise). A CPU
# extractor takes one: its cores are the forward's, and the writes are small beside it.
JOB_SLOTS_GPU = 2
COMPUTE_METHODS = ("pool_concept", "_compute_group", "switch_model")  # an extractor's methods on its compute thread


def probes_per_gpu() -> int | None:
    """$POOLBENCH_PROBES_PER_GPU: how many probe tasks run beside one extractor (None: unset, PROBE_GPU_SHARE's 2);
    0 holds a GPU run's probes until its pooling is done (probe_gate.probes_beside), then 8 share the GPU: the A/B
    for whether probes beside the forward slow it more than they gain (issue 52 item 4)."""
    raw = os.environ.get(PROBES_PER_GPU_ENV)
    if raw is None or raw == "":
        return None
    if not raw.isdigit():
        raise PoolBenchError(f"{PROBES_PER_GPU_ENV}={raw!r}: give a whole number of probe tasks per GPU, 0 or more "
                             "(0: the probes wait for the pooling)")
    return int(raw)


def probe_gpu_share() -> float:
    """A probe task's GPU share: PROBE_GPU_SHARE, or the room beside an extractor over $POOLBENCH_PROBES_PER_GPU
    (with 0, PROBE_GPU_SHARE: the probes run once the extractors are gone)."""
    beside = probes_per_gpu()
    return PROBE_GPU_SHARE if not beside else (1.0 - EXTRACTOR_GPU_SHARE) / beside


def kill_and_wait(actors: Sequence[ActorHandle]) -> None:
    """Kill every actor and return once each is gone: ray.kill only asks, and one still holding a model's memory
    and cores would meet whatever starts next. An actor that already died is fine."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    for actor in actors:
        _wait_gone(actor)


def _wait_gone(actor: ActorHandle, timeout_s: float = 60.0) -> None:
    """Until a killed actor answers no more: a call it still takes means the kill has not reached it yet (seen in
    the test suite under load: a worker answered its pid after release). Gives up quietly after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # RayActorError once it is dead; a timeout or anything else: stop waiting
            return
        time.sleep(0.05)


def plan_workers(cfg: RunConfig, n_jobs: int) -> tuple[int, dict, int | None]:
    """One worker per GPU on a GPU cluster; on CPU one per node with a core to spare for the probe tasks (one on a
    single machine; the probes wait for the pooling there, probe_gate.py), their threads sharing the cluster's
    cores; --num-workers sets the count instead."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and cfg.device != "cpu":
        workers = max(1, min(gpus, n_jobs, cfg.num_workers or gpus))
        return workers, {"num_gpus": EXTRACTOR_GPU_SHARE, "num_cpus": 1}, None
    cpus = max(1, int(ray.cluster_resources().get("CPU", os.cpu_count() or 1)))
    per_node = sum(1 for node in alive_nodes() if node.resources.get("CPU", 0) >= 2) or 1
    workers = max(1, min(cfg.num_workers or per_node, n_jobs))
    threads = cfg.torch_threads or max(1, cpus // workers)
    return workers, {"num_cpus": 1}, threads


def model_load_args(cfg: RunConfig) -> dict:
    """What a worker loads a model with: a fleet's workers are switched when any of it changes, not the name alone."""
    return {"model": cfg.model, "dtype": cfg.dtype, "device": cfg.device, "model_args": dict(cfg.model_args)}


def extractor_spawner(cfg: RunConfig, resources: dict, threads: int | None,
                      strategy_modules: Sequence[str]) -> Callable[[], ActorHandle]:
    """Starts one extractor actor (loading the model once, on a node the SPREAD strategy picks so one node's loss
    takes as few workers as possible); the work queue retries a job whose worker died, so Ray restarts nothing."""
    # Actor threads: progress() answers while a job runs, and a GPU's queue sends a second job (JOB_SLOTS_GPU) whose
    # forwards start once the first job's are done, while its shards are written. torch runs on one thread of the
    # actor's own (poolbench.compute_thread): Ray's threads would give libgomp a team each and throttle them all;
    # a job's writes (pyarrow, hashing, files) run on the calling Ray thread.
    pooling = with_compute_thread(ExtractorWorker, COMPUTE_METHODS)
    worker_cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=1 + JOB_SLOTS_GPU)(pooling)
    options = {**resources, "runtime_env": worker_runtime_env(), "scheduling_strategy": "SPREAD"}
    return lambda: worker_cls.options(**options).remote(  # type: ignore[attr-defined]
        **model_load_args(cfg), torch_threads=threads, strategy_modules=tuple(strategy_modules))


class ExtractorFleet:
    """Owns the extractor actors across the models of one run; leaving the `with` block kills them however the run
    stops. The worker count and threads are planned for the first model and kept for the others."""

    def __init__(self, strategy_modules: Sequence[str] = ()) -> None:
        self.strategy_modules = tuple(strategy_modules)
        self.actors: list[ActorHandle] = []
        self.held: dict | None = None  # model_load_args of the model the workers hold
        self._plan: tuple[int, dict, int | None] | None = None

    @property
    def threads(self) -> int | None:
        """torch threads per worker as planned for the first model (None before it, or on a GPU)."""
        return None if self._plan is None else self._plan[2]

    def __enter__(self) -> ExtractorFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Kill every worker now and return once each is gone (before steering, whose actors want the same GPUs and
        cores: ray.kill only asks, and a worker still holding an 8B model's 16 GB would meet the engine's start)."""
        kill_and_wait(self.actors)
        self.actors, self.held = [], None

    def retire(self, queue: WorkQueue) -> None:
        """No more pooling comes to `queue`: kill its workers (replacements included) now, so the probe tasks still
        running get the cores they held; the queue runs tasks only from here on."""
        self.actors = [*self.actors, *(a for a in queue.actors if a not in self.actors)]
        queue.actors.clear()
        self.release()

    @contextlib.contextmanager
    def queue(self, cfg: RunConfig, n_jobs: int, emit: EventSink) -> Iterator[WorkQueue]:
        """A work queue over workers holding `cfg.model`: started for the first model, switched in place for the
        next; the workers (a lost one's replacement included) stay with the fleet when the queue closes."""
        if self._plan is None:
            self._plan = plan_workers(cfg, n_jobs)
        n_workers, resources, threads = self._plan
        spawn = extractor_spawner(cfg, resources, threads, self.strategy_modules)
        if self.actors and self.held != model_load_args(cfg):
            self._switch(cfg)
        if not self.actors:
            self.actors = [spawn() for _ in range(n_workers)]
        self.held = model_load_args(cfg)
        slots = JOB_SLOTS_GPU if resources.get("num_gpus") else 1
        queue = WorkQueue(self.actors, spawn=spawn, needs=resource_needs(resources), task_needs={"CPU": 1},
                          on_retry=emit, own_actors=False, slots=slots)
        try:
            with queue:
                yield queue
        finally:
            self.actors = list(queue.actors)

    def _switch(self, cfg: RunConfig) -> None:
        """Every worker frees its model and loads `cfg.model`; a worker lost between models is dropped (the queue
        starts a replacement if none is left)."""
        refs = [actor.switch_model.remote(**model_load_args(cfg)) for actor in self.actors]
        kept = []
        for actor, ref in zip(self.actors, refs, strict=True):
            try:
                fetch(ref, f"loading {cfg.model}")
            except WorkerLost:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                continue
            kept.append(actor)
        self.actors = kept
