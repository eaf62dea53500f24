"""D2/D3 after D1: scorers in the driver (stored once), steering cells fanned out over Ray steering actors."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import ray

from poolbench.corpus.layout import Corpus
from poolbench.corpus.passage import signal_only
from poolbench.scorer.artifacts import ensure_scorer, scorer_record
from poolbench.steerer.actor import steering_actors
from poolbench.steerer.d3 import neighbour_map
from poolbench.steerer.plan import DEFAULT_RUN_CONFIG, choose_cells, scorer_concepts
from poolbench.store.artifact_store import ArtifactStore

Event = Callable[[str, dict], None]


def run_steering_on_ray(store: ArtifactStore, store_url: str, corpus: Corpus, pooled_keys: dict[str, str],
                        leaderboard: dict, *, model: str, backend: str, worker_args: dict, runtime_env: dict,
                        full: bool, allow_weak_scorer: bool, emit: Event) -> dict:
    """Choose cells from the D1 leaderboard, make sure every needed scorer exists, then run the cells on actors."""
    started = time.perf_counter()
    config = replace(DEFAULT_RUN_CONFIG, n_prompts=50) if full else DEFAULT_RUN_CONFIG
    concepts = [c for c in corpus.concepts if c in pooled_keys]
    cells = choose_cells(leaderboard, concepts, full=full)
    emit("steering_plan", {"cells": len(cells), "scorers": len(scorer_concepts(cells, concepts))})
    scorers = {}
    for concept in scorer_concepts(cells, concepts):
        t0 = time.perf_counter()
        scorers[concept] = ensure_scorer(store, concept, [signal_only(p) for p in corpus.passages(concept)],
                                         corpus.concept_hash(concept),
                                         allow_weak=allow_weak_scorer)
        emit("scorer", {"concept": concept, "heldout_auroc": scorers[concept].info["heldout_auroc"],
                        "seconds": time.perf_counter() - t0})
    scorer_keys = {c: s.info["key"] for c, s in scorers.items()}
    scorer_seconds = time.perf_counter() - started

    actors = steering_actors(model, backend=backend, runtime_env=runtime_env, **worker_args)
    try:
        idle, pending, d2, d3 = list(actors), {}, [], []
        queue = list(cells)
        neighbours = neighbour_map()
        while queue or pending:
            while queue and idle:
                cell, actor = queue.pop(0), idle.pop(0)
                related = [cell.concept, *(c for c in neighbours.get(cell.concept, {}).values() if c in pooled_keys)]
                ref = actor.run_cell.remote(
                    store_url, cell.concept, cell.strategy, cell.layer, {c: pooled_keys[c] for c in related},
                    {c: scorer_keys[c] for c in related if c in scorer_keys},
                    [p.text for p in corpus.passages(cell.concept, "train")], config.to_record())
                pending[ref] = (cell, actor)
            [ref], _ = ray.wait(list(pending), num_returns=1)
            cell, actor = pending.pop(ref)
            idle.append(actor)
            result = ray.get(ref)
            d2.append({**result["d2"], "selected_because": cell.why})
            d3.extend(result["d3"])
            emit("steered", {"concept": cell.concept, "strategy": cell.strategy, "layer": cell.layer,
                             "scp": result["d2"].get("scp"), "d2_delta": result["d2"].get("d2_delta")})
    finally:
        for actor in actors:
            ray.kill(actor)
    return {"scorers": [scorer_record(s) for s in scorers.values()], "d2": d2, "d3": d3,
            "steering_config": config.to_record(), "subset": "full" if full else "default",
            "timing": {"scorers_s": scorer_seconds, "total_s": time.perf_counter() - started}}
