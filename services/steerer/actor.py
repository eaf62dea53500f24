"""Ray wrapper: a SteeringWorker per GPU (num_gpus=1) or one on CPU, running cells by artefact keys.

Scorers and pooled tables travel as store keys, never as pickled models; the driver fans
(concept, strategy, layer) cells across the actors and collects the records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ray

from poolbench.pooler.pooled_table import read_pooled_layer
from poolbench.records.steering import SteeringResult
from poolbench.scorer.artifacts import load_stored_scorer
from poolbench.store.url import open_store

from .backend import GenerationSettings
from .run import SteeringConfig, run_steering
from .worker import SteeringWorker


class SteeringService(SteeringWorker):
    """SteeringWorker plus a run_cell method whose arguments are plain keys and values."""

    _cell: tuple[str, str, int] | None = None

    def progress(self) -> dict | None:
        """The cell being steered and how far its generation is; None between generations. Answered from the
        actor's second thread while run_cell runs."""
        generating = getattr(self.backend, "progress", None)
        if self._cell is None or generating is None:
            return None
        concept, strategy, layer = self._cell
        return {"concept": concept, "strategy": strategy, "layer": layer, **generating.snapshot()}

    def run_cell(self, store_url: str, concept: str, strategy: str, layer: int, pooled_keys: Mapping[str, str],
                 scorer_keys: Mapping[str, str], train_texts: Sequence[str], config: dict) -> SteeringResult:
        self._cell = (concept, strategy, layer)
        try:
            return self._run_cell(store_url, concept, strategy, layer, pooled_keys, scorer_keys, train_texts,
                                  config)
        finally:
            self._cell = None

    def _run_cell(self, store_url: str, concept: str, strategy: str, layer: int, pooled_keys: Mapping[str, str],
                  scorer_keys: Mapping[str, str], train_texts: Sequence[str], config: dict) -> SteeringResult:
        store = open_store(store_url)
        scorers = {c: load_stored_scorer(store, k, c) for c, k in scorer_keys.items()}
        for c, s in scorers.items():
            s.info["key"] = scorer_keys[c]
        settings = GenerationSettings(**config.get("settings", {}))
        cfg = SteeringConfig(**{**config, "settings": settings})
        tables = {c: read_pooled_layer(store, k, layer) for c, k in pooled_keys.items()}
        return run_steering(store, self, concept, strategy, layer, tables[concept], scorers, cfg,
                            train_texts=train_texts, neighbour_tables=tables)


def actor_count(gpus: int, gpus_per_actor: int, n: int | None) -> int:
    """Engines the cluster holds: one per `gpus_per_actor` GPUs (at most n), else n CPU actors (default 1)."""
    if gpus:
        return max(1, min(n or gpus, gpus // gpus_per_actor or 1))
    return max(1, n or 1)


def steering_actors(model: str, *, n: int | None = None, backend: str = "transformers",
                    runtime_env: dict | None = None, gpus_per_actor: int = 1, **worker_args) -> list:
    """One actor (one engine) per GPU on a GPU cluster, per `gpus_per_actor` GPUs under tensor parallelism; on
    CPU, `n` actors (default one). The driver's work queue fans (concept, strategy, layer) cells across them."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    # A second actor thread answers progress() while run_cell runs; the queue still sends one cell at a time.
    remote_cls = ray.remote(max_restarts=1, max_task_retries=1, max_concurrency=2)(SteeringService)
    options: dict = {"num_gpus": gpus_per_actor, "num_cpus": 1} if gpus else {"num_cpus": 1}
    if runtime_env:
        options["runtime_env"] = runtime_env
    return [remote_cls.options(**options).remote(model, backend=backend, **worker_args)
            for _ in range(actor_count(gpus, gpus_per_actor, n))]
