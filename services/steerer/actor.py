"""Ray wrapper: a SteeringWorker per GPU (num_gpus=1) or one on CPU, running groups of cells by artefact keys.

Scorers and pooled tables travel as store keys, never as pickled models; the driver fans groups of
(concept, strategy, layer) cells across the actors (each group one engine call) and collects the records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import pyarrow as pa
import ray
from ray.actor import ActorHandle

from poolbench.compute_thread import with_compute_thread
from poolbench.pooler.gradient_sums import read_gradient_table
from poolbench.pooler.pooled_table import read_pooled_layer
from poolbench.records.steering import SteeringResult
from poolbench.scorer.artifacts import load_stored_scorer
from poolbench.store.url import open_store

from .d3 import neighbour_map
from .plan import SteeringCell
from .run import CellInputs, SteeringConfig, run_steering_cells
from .worker import SteeringWorker

# What touches the model; progress() and info() answer from Ray's other thread meanwhile.
COMPUTE_METHODS = ("run_cells", "generate", "generate_rows", "residual_norm", "residual_norms", "nll", "reference_nll",
                   "prepare_reference", "relevance")


class SteeringService(SteeringWorker):
    """SteeringWorker plus a run_cells method whose arguments are plain keys and values."""

    _cells: tuple[SteeringCell, ...] = ()

    def progress(self) -> dict | None:
        """The group being steered (its first cell and how many it holds) and how far its generation is; None
        between generations. Answered from the actor's second thread while run_cells runs."""
        generating = getattr(self.backend, "progress", None)
        if not self._cells or generating is None:
            return None
        first = self._cells[0]
        return {"concept": first.concept, "strategy": first.strategy, "layer": first.layer,
                "cells": len(self._cells), "pid": os.getpid(), **generating.snapshot()}

    def run_cells(self, store_url: str, cells: Sequence[SteeringCell], pooled_keys: Mapping[str, str],
                  scorer_keys: Mapping[str, str], train_texts: Mapping[str, Sequence[str]], config: dict,
                  ) -> list[SteeringResult]:
        """The cells' results in order: stored ones read back, the rest through one generate call.
        `pooled_keys` and `scorer_keys` cover the cells' concepts and their neighbours, `train_texts` the concepts."""
        self._cells = tuple(cells)
        try:
            return self._run_cells(store_url, cells, pooled_keys, scorer_keys, train_texts, config)
        finally:
            self._cells = ()

    def _run_cells(self, store_url: str, cells: Sequence[SteeringCell], pooled_keys: Mapping[str, str],
                   scorer_keys: Mapping[str, str], train_texts: Mapping[str, Sequence[str]], config: dict,
                   ) -> list[SteeringResult]:
        store = open_store(store_url)
        scorers = {c: load_stored_scorer(store, k, c) for c, k in scorer_keys.items()}
        for c, s in scorers.items():
            s.info["key"] = scorer_keys[c]
        cfg = SteeringConfig.from_message(config)
        tables: dict[tuple[str, int], pa.Table] = {}

        gradients: dict[tuple[str, int], pa.Table | None] = {}

        def table(concept: str, layer: int) -> pa.Table:
            if (concept, layer) not in tables:
                tables[concept, layer] = read_pooled_layer(store, pooled_keys[concept], layer)
            return tables[concept, layer]

        def gradient_table(concept: str, layer: int) -> pa.Table | None:
            if (concept, layer) not in gradients:
                gradients[concept, layer] = read_gradient_table(store, pooled_keys[concept], layer)
            return gradients[concept, layer]

        inputs = []
        near = neighbour_map()
        for cell in cells:
            related = [c for c in (cell.concept, *near.get(cell.concept, {}).values()) if c in pooled_keys]
            inputs.append(CellInputs(cell.concept, cell.strategy, cell.layer, table(cell.concept, cell.layer),
                                     train_texts[cell.concept],
                                     neighbour_tables={c: table(c, cell.layer) for c in related},
                                     gradient_table=gradient_table(cell.concept, cell.layer)))
        return run_steering_cells(store, self, inputs, scorers, cfg)


def actor_count(gpus: int, gpus_per_actor: int, n: int | None) -> int:
    """Engines the cluster holds: one per `gpus_per_actor` GPUs (at most n), else n CPU actors (default 1)."""
    if gpus:
        return max(1, min(n or gpus, gpus // gpus_per_actor or 1))
    return max(1, n or 1)


def steering_spawner(model: str, *, n: int | None = None, backend: str = "transformers",
                     runtime_env: dict | None = None, gpus_per_actor: int = 1, cpus_per_actor: float = 1,
                     **worker_args) -> tuple[Callable[[], ActorHandle], dict, int]:
    """What starts one steering actor, its Ray options, and how many the cluster holds: one engine per GPU (per
    `gpus_per_actor` GPUs under tensor parallelism), else `n` CPU actors (default one), spread over the nodes.
    Ray restarts none: the driver's work queue runs a lost actor's cells again on another one. `cpus_per_actor`
    is the CPU Ray counts for it (0 for an engine started beside D1's probe tasks: driver/early_engines.py)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    # A second actor thread answers progress() while run_cells runs; the queue still sends one group at a time.
    # torch runs on one thread of the actor's own (poolbench.compute_thread): Ray's threads would give libgomp
    # a team each and throttle them all.
    service = with_compute_thread(SteeringService, COMPUTE_METHODS)
    remote_cls = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)(service)
    options: dict = {"num_gpus": gpus_per_actor, "num_cpus": cpus_per_actor} if gpus else {"num_cpus": cpus_per_actor}
    if runtime_env:
        options["runtime_env"] = runtime_env

    def spawn() -> ActorHandle:
        return remote_cls.options(**options, scheduling_strategy="SPREAD").remote(  # type: ignore[attr-defined]
            model, backend=backend, **worker_args)

    return spawn, options, actor_count(gpus, gpus_per_actor, n)


def steering_actors(model: str, **options) -> list[ActorHandle]:
    """The steering actors the cluster holds (see steering_spawner), started now."""
    spawn, _, count = steering_spawner(model, **options)
    return [spawn() for _ in range(count)]
