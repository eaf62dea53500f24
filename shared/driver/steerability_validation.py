"""`make run-steerability`: does first-order steerability (driver.steerability_stage) measure what steering does?

For a few concepts x every strategy, in this process: pool with S2's gradient sums, compute each cell's
first-order S, the exact log-likelihood shift at alpha (the DiffMean vector added at the layer, the same test
passages scored again), and generation-based D2 on a short alpha grid through the steering backend (vLLM's CPU
build by default); then steerer.steerability_check's verdict, written as JSON and a findings page.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import Passage
from poolbench.corpus.source import open_corpus, passages_digest
from poolbench.errors import PoolBenchError
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.concept_pooling import PooledConcept, pool_concept_tables
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import list_strategies
from poolbench.pooler.spec import StrategySpec
from poolbench.records.steering import D2Record
from poolbench.scorer.artifacts import ensure_scorers
from poolbench.scorer.scorer_model import ScorerModel
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.cell_steerability import cell_steerability
from poolbench.steerer.run import CellInputs, SteeringConfig, run_steering_cells, steering_vector
from poolbench.steerer.shift_replay import replayed_shifts
from poolbench.steerer.steerability import exact_steerability
from poolbench.steerer.steerability_check import SteerabilityVerdict, ValidationCell, steerability_verdict
from poolbench.steerer.worker import SteeringWorker
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key
from poolbench.store.url import open_store

VALIDATION_VERSION = 2  # 2: exact shifts replayed from the layer (shift_replay), per-concept records resume


@dataclass(frozen=True)
class ValidationSettings:
    concepts: tuple[str, ...] | None = None  # default: the corpus's first n_concepts
    n_concepts: int = 3
    alpha: float = 0.1
    layer: int | None = None  # every strategy at this layer; default: the leaderboard's, else the middle one
    leaderboard: Path | None = None  # a run's leaderboard.json: each strategy at its chosen layer
    d2: bool = True
    d2_alphas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.4)
    n_prompts: int | None = 20
    prompts_file: str | None = None  # default: the bundled neutral prompts
    max_new_tokens: int = 32
    backend: str = "vllm"
    allow_weak_scorer: bool = False
    batch_size: int = 16
    max_length: int = 256
    seed: int = 0
    budget_s: float | None = None  # start no concept that the last one's time says would end past this
    strategies: tuple[str, ...] = field(default_factory=lambda: tuple(s.id for s in list_strategies()))


@dataclass(frozen=True)
class ValidationRun:
    model: str
    weights_hash: str
    corpus: str
    concepts: tuple[str, ...]  # those that ran: a budget may stop it before all the planned ones
    cells: tuple[ValidationCell, ...]
    verdict: SteerabilityVerdict
    settings: dict
    seconds: dict[str, float]
    machine: dict | None = None  # the load average while it ran (LoadSampler)
    profile: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # per concept: stage seconds
    planned: tuple[str, ...] = ()  # the concepts it set out to validate
    scorer_auroc: dict[str, float | None] = dataclasses.field(default_factory=dict)  # classifier B's held-out

    def to_record(self) -> dict:
        return {"model": self.model, "weights_hash": self.weights_hash, "corpus": self.corpus,
                "concepts": list(self.concepts), "settings": self.settings, "seconds": self.seconds,
                "planned": list(self.planned), "scorer_auroc": self.scorer_auroc, "machine": self.machine,
                "profile": self.profile,
                "verdict": self.verdict.to_record(),
                "cells": [c.to_record() for c in self.cells]}


class LoadSampler:
    """The 1-minute load average every `every_s` seconds while a run lasts: its timings mean little on a shared
    machine without it."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s, self.samples = every_s, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.samples.append(os.getloadavg()[0])

    def record(self) -> dict:
        return {"every_s": self.every_s, "cpus": os.cpu_count(), "n": len(self.samples),
                "mean": round(float(np.mean(self.samples)), 2), "max": round(float(np.max(self.samples)), 2)}


def strategy_layers(settings: ValidationSettings, n_layers: int) -> dict[str, int]:
    """Each strategy's layer: --layer for all, else the leaderboard's chosen layer, else the middle layer."""
    if settings.layer is not None:
        if not 0 <= settings.layer < n_layers:
            raise PoolBenchError(f"--layer {settings.layer}: the model has layers 0..{n_layers - 1}")
        return dict.fromkeys(settings.strategies, settings.layer)
    middle = n_layers // 2
    if settings.leaderboard is None:
        return dict.fromkeys(settings.strategies, middle)
    try:
        rows = json.loads(settings.leaderboard.read_text())["strategies"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PoolBenchError(f"{settings.leaderboard}: not a leaderboard.json ({exc})") from exc
    chosen = {row["strategy"]: int(row["best_layer"]) for row in rows}
    return {s: chosen.get(s, middle) for s in settings.strategies}


def _d2_shift(record: D2Record, alpha: float) -> float | None:
    rows = {float(r.alpha): r.score for r in record.per_alpha or []}
    return None if alpha not in rows or 0.0 not in rows else float(rows[alpha]) - float(rows[0.0])


def _concept_key(kind: str, weights_hash: str, concept: str, passages: Sequence[Passage], layers: Mapping[str, int],
                 settings: ValidationSettings, **more: object) -> str:
    return artifact_key(kind, weights=weights_hash, concept=concept, passages=passages_digest(passages),
                        layers=sorted(layers.items()), alpha=settings.alpha, max_length=settings.max_length,
                        version=VALIDATION_VERSION, **more)


def _score_concept(loaded: LoadedModel, concept: str, passages: Sequence[Passage], specs: Sequence[StrategySpec],
                   layers: Mapping[str, int], settings: ValidationSettings,
                   ) -> tuple[list[ValidationCell], dict[int, pa.Table], dict[str, float]]:
    """Pool with gradient sums, then each strategy's first-order S and its exact shift: every vector of a layer
    replayed from that layer as one batch dimension over the same test passages (shift_replay)."""
    t0 = time.perf_counter()
    unsupervised = [s for s in specs if s.supervision == "none"]  # a supervised strategy has no steering vector
    pooled: PooledConcept = pool_concept_tables(loaded, passages, sorted(set(layers.values())), unsupervised,
                                                batch_size=settings.batch_size, max_length=settings.max_length)
    t1 = time.perf_counter()
    test = [p for p in passages if p.split == "test"]
    texts, y = [p.text for p in test], np.array([p.label for p in test])
    cells: dict[str, ValidationCell] = {}
    live: dict[int, list[tuple[str, float, np.ndarray]]] = {}
    for spec in specs:
        layer = layers[spec.id]
        view = PooledTableView(pooled.layers[layer])
        gradients = None if pooled.layer_gradients is None else pooled.layer_gradients.get(layer)
        first = cell_steerability(view, gradients, concept, spec.id, layer)
        if first.steerability is None or first.residual_norm is None:
            cells[spec.id] = ValidationCell(concept, spec.id, layer, None, None, null_reason=first.null_reason)
            continue
        vector = steering_vector(view, concept, spec.id, layer).with_residual_norm(first.residual_norm)
        live.setdefault(layer, []).append((spec.id, first.steerability, vector.delta(settings.alpha)))
    for layer, rows in live.items():
        base, steered = replayed_shifts(loaded, texts, layer, np.stack([d for _, _, d in rows]),
                                        batch_size=settings.batch_size, max_length=settings.max_length)
        for (strategy, first_order, _), logp in zip(rows, steered, strict=True):
            cells[strategy] = ValidationCell(concept, strategy, layer, first_order,
                                             exact_steerability(logp, base, y, settings.alpha))
    seconds = {"pool_s": t1 - t0, "exact_s": time.perf_counter() - t1}
    return [cells[s.id] for s in specs], pooled.layers, seconds


def _stored_concept(store: ArtifactStore, loaded: LoadedModel, concept: str, passages: Sequence[Passage],
                    specs: Sequence[StrategySpec], layers: Mapping[str, int], settings: ValidationSettings,
                    on_line: Callable[[str], None]) -> tuple[list[ValidationCell], dict[int, pa.Table], dict]:
    """A concept's cells and pooled tables: read back when a run (perhaps killed later) stored them, else scored
    and stored, the tables first and the cells last, so a record in the store means the concept is complete;
    with the seconds its pooling and exact scoring took when they ran (read back too, marked so)."""
    key = _concept_key("steerability_cells", loaded.weights_hash, concept, passages, layers, settings)
    table_keys = {L: _concept_key("steerability_pooled", loaded.weights_hash, concept, passages, layers, settings,
                                  layer=L) for L in sorted(set(layers.values()))}
    if store.exists(key):
        stored = store.get_json(key)
        cells = [ValidationCell(**c) for c in stored["cells"]]
        on_line(f"{concept}: {len(cells)} cells read back from the store")
        return cells, {L: store.get_table(k) for L, k in table_keys.items()}, {**stored["seconds"], "read_back": 1}
    cells, tables, seconds = _score_concept(loaded, concept, passages, specs, layers, settings)
    for L, k in table_keys.items():
        store.put_table(k, tables[L], metadata={"concept": concept, "layer": str(L)})
    store.put_json(key, {"cells": [c.to_record() for c in cells], "seconds": seconds})
    n_live = sum(c.exact is not None for c in cells)
    on_line(f"{concept}: pooled {len(passages)} passages in {seconds['pool_s']:.0f} s; exact shift of {n_live} "
            f"vectors over {sum(p.split == 'test' for p in passages)} test passages in {seconds['exact_s']:.0f} s")
    return cells, tables, seconds


def run_validation(model: str, corpus: str, corpus_size: str, store_url: str, settings: ValidationSettings,
                   on_line: Callable[[str], None] = print, *, worker: SteeringWorker | None = None,
                   scorers: Mapping[str, ScorerModel] | None = None) -> ValidationRun:
    """Every cell's three measures and the verdict; D2 through `settings.backend` unless `settings.d2` is off.
    Each concept's scores and each D2 cell are stored as they finish, so a killed run resumes where it stopped.
    `worker` and `scorers` (tests) stand in for the model named and the scorers the store trains."""
    with LoadSampler() as load:
        run = _validate(model, corpus, corpus_size, store_url, settings, on_line, worker, scorers)
    return dataclasses.replace(run, machine=load.record())


def _validate(model: str, corpus: str, corpus_size: str, store_url: str, settings: ValidationSettings,
              on_line: Callable[[str], None], worker: SteeringWorker | None,
              scorers: Mapping[str, ScorerModel] | None) -> ValidationRun:
    started = time.perf_counter()
    source = open_corpus(corpus, corpus_size, list(settings.concepts) if settings.concepts else None)
    concepts = tuple(source.concepts[:settings.n_concepts] if not settings.concepts else source.concepts)
    if len(concepts) < 1:
        raise PoolBenchError(f"corpus {corpus} has no concepts to validate on")
    store = open_store(store_url)
    if worker is None:
        worker = SteeringWorker(model, backend=settings.backend if settings.d2 else "transformers")
    loaded = worker.loaded
    layers = strategy_layers(settings, loaded.n_layers)
    specs = [s for s in list_strategies() if s.id in settings.strategies]
    seconds = dict.fromkeys(("load_s", "first_order_and_exact_s", "scorers_s", "d2_s"), 0.0)
    seconds["load_s"] = time.perf_counter() - started
    config = SteeringConfig(alphas=settings.d2_alphas, n_prompts=settings.n_prompts, seed=settings.seed,
                            prompts_file=settings.prompts_file,
                            settings=GenerationSettings(max_new_tokens=settings.max_new_tokens))
    given = dict(scorers or {})
    cells: list[ValidationCell] = []
    profile: dict[str, dict[str, float]] = {}
    scorer_auroc: dict[str, float | None] = {}
    ran: list[str] = []
    for concept in concepts:  # each concept whole (exact, then D2) before the next: a cut-off run has whole concepts
        t0 = time.perf_counter()
        last = max((sum(v for k, v in profile[c].items() if k.endswith("_s")) for c in ran), default=0.0)
        if settings.budget_s is not None and ran and t0 - started + last > settings.budget_s:
            on_line(f"stopping before {concept}: {t0 - started:.0f} s spent, a concept took {last:.0f} s, the "
                    f"budget is {settings.budget_s:.0f} s")
            break
        ran.append(concept)
        passages = source.passages(concept)
        concept_cells, tables, profile[concept] = _stored_concept(store, loaded, concept, passages, specs, layers,
                                                                  settings, on_line)
        seconds["first_order_and_exact_s"] += time.perf_counter() - t0
        train_texts = [p.text for p in passages if p.split == "train"]
        inputs = [CellInputs(concept, c.strategy, c.layer, tables[c.layer], train_texts, None)
                  for c in concept_cells if c.exact is not None]
        if not settings.d2 or not inputs:
            cells.extend(concept_cells)
            continue
        t1 = time.perf_counter()
        if concept not in given:
            given.update(ensure_scorers(store, source, [concept], allow_weak=settings.allow_weak_scorer))
        t2 = time.perf_counter()
        auroc = given[concept].info.get("heldout_auroc")
        scorer_auroc[concept] = None if auroc is None else round(float(auroc), 3)
        results = run_steering_cells(store, worker, inputs, given, config)
        d2 = {r.d2.strategy: r.d2 for r in results}
        # D2's cost as measured when each cell ran (its record's seconds: its share of the shared generation and
        # reference pass, and its own scoring), so a resumed run that reads the cells back still shows it
        profile[concept]["d2_s"] = sum(float(r.d2.seconds or 0.0) for r in results)
        profile[concept]["d2_this_run_s"] = time.perf_counter() - t2
        seconds["scorers_s"] += t2 - t1
        seconds["d2_s"] += time.perf_counter() - t2
        on_line(f"{concept}: D2 on {len(inputs)} cells, {profile[concept]['d2_s']:.0f} s as they ran "
                f"({profile[concept]['d2_this_run_s']:.0f} s in this run)")
        cells.extend(c if c.strategy not in d2 else ValidationCell(
            c.concept, c.strategy, c.layer, c.first_order, c.exact, d2[c.strategy].d2_delta,
            _d2_shift(d2[c.strategy], settings.alpha)) for c in concept_cells)
    seconds["total_s"] = time.perf_counter() - started
    verdict = steerability_verdict(cells, settings.alpha, seed=settings.seed)
    record = {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
              for k, v in settings.__dict__.items()}
    return ValidationRun(loaded.model_id, loaded.weights_hash, f"{corpus}:{corpus_size}", tuple(ran), tuple(cells),
                         verdict, record, {k: round(v, 1) for k, v in seconds.items()},
                         profile={c: {k: round(v, 1) for k, v in by.items()} for c, by in profile.items()},
                         planned=concepts, scorer_auroc=scorer_auroc)
