"""Steering engines started when a CPU run's last pooling job is done, so their start-up runs beside D1's last
probe tasks instead of after them.

Why: on a CPU the probe tasks wait for the pooling (probe_gate.py), then hold both cores for a minute or two, and
the steering engine's start-up came after them: 93 s of the default run's 20 minutes at e335945 (vLLM's two
process spawns and imports, Dynamo and Inductor compiling the model on one core, one warm-up forward;
bench/README.md). Started as the pooling ends, it overlaps the probes. These actors ask Ray for no CPU, so the
probe tasks keep the cores Ray counts and the OS shares them while both run; once D1 is done nothing else runs
beside the engine. Only on a CPU run of one model: on a GPU the engine would take the memory the probes use there
(vLLM's gpu_memory_utilization) and the probes run beside the pooling anyway; a fleet's workers stay on for the
next model's pooling, which an engine would slow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ray.actor import ActorHandle

from poolbench.config import RunConfig

from .extractor_fleet import kill_and_wait, worker_runtime_env


@dataclass(frozen=True)
class EngineSettings:
    """What starts a run's steering actors: steerer.actor.steering_spawner's arguments."""

    model: str
    backend: str
    runtime_env: dict
    worker_args: dict
    gpus_per_actor: int = 1
    n_actors: int | None = None
    reference_model: str = "auto"  # the fluency guard's reference (RunConfig.reference_model), loaded ahead


def engine_settings(cfg: RunConfig, threads: int | None) -> EngineSettings:
    """The steering actors `cfg` asks for, with the extractors' torch thread count (None on a GPU)."""
    vllm = cfg.backend == "vllm"
    return EngineSettings(
        model=cfg.model, backend=cfg.backend, runtime_env=worker_runtime_env(),
        worker_args={"dtype": cfg.dtype, "device": cfg.device, "model_args": dict(cfg.model_args),
                     "torch_threads": threads,
                     **({"vllm_args": {"dtype": cfg.dtype, "tensor_parallel_size": cfg.tensor_parallel_size,
                                       "eager": cfg.vllm_eager}} if vllm else {})},
        gpus_per_actor=cfg.tensor_parallel_size if vllm else 1, reference_model=cfg.reference_model)


@dataclass
class SteeringEngines:
    """Started steering actors, how to start one more (a lost actor's replacement) and the Ray options it takes."""

    spawn: Callable[[], ActorHandle]
    options: dict
    actors: list[ActorHandle]


def start_engines(settings: EngineSettings, *, cpus_per_actor: float = 1) -> SteeringEngines:
    """The cluster's steering actors, started now (each starts its engine in its constructor, in the background)."""
    from poolbench.steerer.actor import steering_spawner

    spawn, options, count = steering_spawner(
        settings.model, n=settings.n_actors, backend=settings.backend, runtime_env=settings.runtime_env,
        gpus_per_actor=settings.gpus_per_actor, cpus_per_actor=cpus_per_actor, **settings.worker_args)
    return SteeringEngines(spawn, options, [spawn() for _ in range(count)])


def start_ahead(cfg: RunConfig, on_gpu: bool) -> bool:
    """Whether a run with extractors of its own (not a fleet's, which pool the next model) starts its steering
    engines when its last pooling job is done: it steers, on a CPU."""
    return cfg.steering and not on_gpu


class EarlyEngines:
    """A run's steering engines started ahead of the steering stage. A context that kills them when it closes,
    whether the stage took them or not: the stage's work queue kills its actors too, but a stage that fails
    before its queue (a scorer, a cell plan) must not leave an engine holding its memory and cores."""

    def __init__(self) -> None:
        self._engines: SteeringEngines | None = None
        self._prepared: list = []  # the reference loads (each answers None, or why it could not load)
        self._taken = False

    def start(self, settings: EngineSettings) -> None:
        """Start the engines now (once), beside whatever probe tasks still run: Ray counts no CPU for them. Each
        then loads the fluency guard's reference model (SteeringWorker.prepare_reference), queued behind its
        engine's start: the load (a 1 GB file that this CPU's page cache did not hold, bench/README.md) runs
        beside D1's last probes instead of in the steering stage, between generation and the guard."""
        if self._engines is None:
            self._engines = start_engines(settings, cpus_per_actor=0)
            self._prepared = [actor.prepare_reference.remote(settings.reference_model)
                              for actor in self._engines.actors]

    def after(self, retire: Callable[[], None], ahead: bool, settings: Callable[[], EngineSettings]
              ) -> Callable[[], None]:
        """What runs when the last pooling job is done: `retire` (the extractors leave), then, where `ahead`,
        the engines start with the settings known by then (the extractors' thread count)."""
        def pooled() -> None:
            retire()
            if ahead:
                self.start(settings())
        return pooled

    def take(self) -> SteeringEngines | None:
        """The engines started ahead, for the steering stage (None if none were, or they were taken before)."""
        if self._taken:
            return None
        self._taken = True
        return self._engines

    def __enter__(self) -> EarlyEngines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        engines, self._engines = self._engines, None
        kill_and_wait(engines.actors if engines is not None else [])  # those the stage's queue killed too
