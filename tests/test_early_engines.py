"""On a CPU run the steering engines start when the last pooling job is done, beside D1's probe tasks
(driver/early_engines.py): Ray counts no CPU for them, the steering stage steers on those very engines, and they
are killed when the run closes, whether the stage took them or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

import poolbench.driver.early_engines as early_engines
from poolbench.api import evaluate_config
from poolbench.config import RunConfig
from poolbench.driver.early_engines import EarlyEngines, EngineSettings, start_ahead
from poolbench.driver.nodes import process_id
from poolbench.records.events import ConceptPooled, ConceptProbed, SteeringStarted


def test_only_a_steering_run_on_a_cpu_starts_ahead():
    assert start_ahead(RunConfig(steering=True), on_gpu=False)
    assert not start_ahead(RunConfig(steering=True), on_gpu=True)  # vLLM would take the probes' GPU memory
    assert not start_ahead(RunConfig(steering=False), on_gpu=False)


def test_a_cpu_run_starts_its_engine_as_the_pooling_ends_and_steers_on_it(tiny_llama_dir, local_ray, cache,
                                                                          tmp_path: Path, monkeypatch):
    events: list[object] = []
    started: list[tuple[int, float, int]] = []  # (events seen by then, Ray CPUs per actor, the actor's pid)
    real = early_engines.start_engines

    def recording(settings: EngineSettings, *, cpus_per_actor: float = 1):
        engines = real(settings, cpus_per_actor=cpus_per_actor)
        [actor] = engines.actors
        started.append((len(events), engines.options["num_cpus"], ray.get(process_id(actor), timeout=120)))
        return engines

    monkeypatch.setattr(early_engines, "start_engines", recording)
    cfg = RunConfig(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny",
                    concepts=("imdb_sentiment", "frustration"), strategies=("A1_mean", "P1_last"),
                    store=str(tmp_path / "store"), out=str(tmp_path / "run"), n_bootstrap=100, torch_threads=1,
                    reliability=False, steering=True, backend="transformers", allow_weak_scorer=True)
    result = evaluate_config(cfg, on_event=events.append)
    [(at, cpus, pid)] = started  # started once, ahead, and Ray counts no CPU for it
    assert cpus == 0
    pooled = [i for i, e in enumerate(events) if isinstance(e, ConceptPooled) and not e.skipped]
    probed = [i for i, e in enumerate(events) if isinstance(e, ConceptProbed) and not e.skipped]
    assert len(pooled) == len(probed) == 2
    assert max(pooled) < at <= min(probed)  # after the last pooling, before any concept's D1 is gathered
    [steering] = [e for e in events if isinstance(e, SteeringStarted)]
    assert steering.worker_pids == (pid,)  # the stage steered on the engine started ahead, not a new one
    assert len(result.d2) == 4 and all(r.status == "ok" for r in result.d2)


def test_the_engines_are_killed_when_the_run_closes_taken_or_not(tiny_llama_dir, local_ray, cache):
    """Started once however often asked, handed over once, and killed when the run's context closes: also the
    ones the steering stage took (a stage that fails before its work queue would leave them running)."""
    settings = EngineSettings(model=str(tiny_llama_dir), backend="transformers", runtime_env={},
                              worker_args={"device": "cpu", "torch_threads": 1})
    for take in (False, True):
        with EarlyEngines() as early:
            early.start(settings)
            early.start(settings)  # once only
            engines = early.take() if take else None
            assert take == (engines is not None)
            if take:
                assert early.take() is None  # handed over once
            [actor] = early._engines.actors  # type: ignore[union-attr]
            assert engines is None or engines.actors == [actor]
            ray.get(process_id(actor), timeout=120)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.__ray_ready__.remote(), timeout=60)


def test_each_engine_started_ahead_loads_the_fluency_guards_reference_model(tiny_llama_dir, local_ray, cache):
    """The reference model loads on the engine's actor as soon as its engine is up (beside D1's last probes),
    so the steering stage's guard finds it loaded; "self" loads nothing beside the steered model."""
    for reference, loaded in ((str(tiny_llama_dir), [str(tiny_llama_dir)]), ("self", [])):
        settings = EngineSettings(model=str(tiny_llama_dir), backend="transformers", runtime_env={},
                                  worker_args={"device": "cpu", "torch_threads": 1}, reference_model=reference)
        with EarlyEngines() as early:
            early.start(settings)
            assert ray.get(early._prepared, timeout=120) == [None]
            [actor] = early.take().actors  # type: ignore[union-attr]
            assert ray.get(actor.__ray_call__.remote(lambda self: list(self._references)), timeout=60) == loaded


def test_a_run_hands_its_reference_model_option_to_the_engines_it_starts_ahead():
    cfg = RunConfig(steering=True, reference_model="embedded-gemma")
    assert early_engines.engine_settings(cfg, threads=1).reference_model == "embedded-gemma"
    assert early_engines.engine_settings(RunConfig(steering=True), threads=1).reference_model == "auto"
