"""D2/D3 after D1: scorers in the driver (stored once), groups of steering cells on the work queue's steering actors:
each engine gets its share of the cells in as few calls as fit the row bound (plan.cells_per_call)."""

from __future__ import annotations

import time

from poolbench.config import RunConfig
from poolbench.corpus.layout import Corpus
from poolbench.records.cluster import ClusterActivity
from poolbench.records.d1 import D1CellRecord
from poolbench.records.events import (
    CellProgress,
    CellSteered,
    EventSink,
    ScorerReady,
    SteeringPlanned,
    SteeringStarted,
)
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.scorer.artifacts import ensure_scorers, scorer_record
from poolbench.scorer.finetune import ScorerConfig
from poolbench.steerer.d3 import neighbour_map
from poolbench.steerer.fluency import AUTO
from poolbench.steerer.plan import (
    SteeringCell,
    cell_groups,
    cells_per_call,
    choose_cells,
    scorer_concepts,
    steering_config,
)
from poolbench.store.artifact_store import ArtifactStore

from .early_engines import EngineSettings, SteeringEngines, engine_settings, start_engines
from .nodes import process_id, resource_needs
from .run_plan import RunInputs, RunPlan
from .work_queue import ActorJob, WorkQueue, fetch, poll_actors


def steer(cfg: RunConfig, inputs: RunInputs, run: RunPlan, records: list[D1CellRecord], threads: int | None,
          emit: EventSink, engines: SteeringEngines | None = None) -> dict:
    """D2/D3 on the cells the D1 leaderboard picks (the default subset, or every cell with --full), on `engines`
    started ahead (early_engines.py) or on engines started now."""
    return run_steering_on_ray(
        inputs.store, inputs.store_url, inputs.corpus, {p.concept: p.pooled_key for p in run.plans},
        build_leaderboard(records), engine_settings(cfg, threads), full=cfg.full,
        allow_weak_scorer=cfg.allow_weak_scorer, emit=emit, seed=cfg.seed, reference_model=cfg.reference_model,
        engines=engines)


def run_steering_on_ray(store: ArtifactStore, store_url: str, corpus: Corpus, pooled_keys: dict[str, str],
                        leaderboard: dict, settings: EngineSettings, *, full: bool, allow_weak_scorer: bool,
                        emit: EventSink, seed: int = 0, reference_model: str = AUTO,
                        engines: SteeringEngines | None = None) -> dict:
    """Choose cells from the D1 leaderboard, make sure every needed scorer exists, then run the cells on actors:
    `engines` started ahead (early_engines.py), or the engines `settings` describes, started now."""
    started = time.perf_counter()
    config = steering_config(full, seed, reference_model)
    concepts = [c for c in corpus.concepts if c in pooled_keys]
    cells = choose_cells(leaderboard, concepts, full=full)
    needed = scorer_concepts(cells, concepts)
    emit(SteeringPlanned(cells=len(cells), scorers=len(needed)))
    scorers = ensure_scorers(store, corpus, needed, ScorerConfig(seed=seed), allow_weak=allow_weak_scorer,
                             on_ready=lambda s, seconds: emit(ScorerReady(s.info["concept"], s.info["heldout_auroc"],
                                                                          seconds)))
    scorer_keys = {c: s.info["key"] for c, s in scorers.items()}
    scorer_seconds = time.perf_counter() - started
    neighbours = neighbour_map()

    def job(group: tuple[SteeringCell, ...]) -> ActorJob[tuple[SteeringCell, ...]]:
        own = list(dict.fromkeys(cell.concept for cell in group))
        near = [c for concept in own for c in neighbours.get(concept, {}).values() if c in pooled_keys]
        related = list(dict.fromkeys([*own, *near]))
        return ActorJob(group, lambda actor: actor.run_cells.remote(
            store_url, list(group), {c: pooled_keys[c] for c in related},
            {c: scorer_keys[c] for c in related if c in scorer_keys},
            {c: [p.text for p in corpus.passages(c, "train")] for c in own}, config.to_message()))

    d2, d3 = [], []
    engines = engines if engines is not None else start_engines(settings)
    spawn, options, actors = engines.spawn, engines.options, engines.actors
    groups = cell_groups(cells, engines=len(actors), per_call=cells_per_call(config))
    with WorkQueue[tuple[SteeringCell, ...]](actors, spawn=spawn, needs=resource_needs(options), on_retry=emit,
                                             label=group_label) as queue:
        pids = tuple(fetch(process_id(actor), "a steering engine's start") for actor in actors)
        engines = [e for e in (fetch(engine_info(actor), "a steering engine's start") for actor in actors) if e]
        emit(SteeringStarted(worker_pids=pids, nodes=tuple(queue.nodes()), engines=tuple(
            f"vLLM {e['engine']}, started in {e['engine_start_s']:.1f} s" for e in engines)))
        for group, results in queue.run([job(group) for group in groups],
                                        on_wait=lambda: poll_steering(queue.actors, emit)):
            for cell, result in zip(group, results, strict=True):
                d2.append(result.d2.selected(cell.why))
                d3.extend(result.d3)
                emit(CellSteered(cell.concept, cell.strategy, cell.layer, result.d2.scp, result.d2.d2_delta))
    return {"scorers": [scorer_record(s) for s in scorers.values()], "d2": d2, "d3": d3,
            "cluster": ClusterActivity().merged("steer", queue.done_on, queue.lost_nodes, queue.retried),
            "steering_config": config.to_record(), "subset": "full" if full else "default",
            "timing": {"scorers_s": scorer_seconds, "total_s": time.perf_counter() - started,
                       **({"engine_start_s": max(e["engine_start_s"] for e in engines)} if engines else {})}}


def engine_info(actor):
    """A ref to the actor's engine mode and start-up seconds (vLLM backend; empty for transformers)."""
    return actor.__ray_call__.remote(lambda self: getattr(self.backend, "engine_info", dict)())


def group_label(group: tuple[SteeringCell, ...]) -> str:
    """A steering job as a progress line names it: its first cell, and how many more it holds."""
    first = group[0]
    more = f" (+{len(group) - 1} cells)" if len(group) > 1 else ""
    return f"steer {first.concept}/{first.strategy}/layer {first.layer}{more}"


def poll_steering(actors, emit: EventSink) -> None:
    """Each busy steering actor's place inside its group's generation, as CellProgress events."""
    for state in poll_actors(actors):
        emit(CellProgress(state["concept"], state["strategy"], state["layer"], state["tokens_done"],
                          state["tokens_total"], state["seconds"], cells=state.get("cells", 1),
                          worker_pid=state.get("pid", 0)))
