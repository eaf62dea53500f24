"""`make run-steerability`: does first-order steerability (driver.steerability_stage) measure what steering does?

For a few concepts x every strategy, in this process: pool with S2's gradient sums, compute each cell's
first-order S, the exact log-likelihood shift at alpha (the DiffMean vector added at the layer, the same test
passages scored again), and generation-based D2 on a short alpha grid through the steering backend (vLLM's CPU
build by default); then steerer.steerability_check's verdict, written as JSON and a findings page.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolbench.corpus.source import open_corpus
from poolbench.errors import PoolBenchError
from poolbench.pooler.concept_pooling import PooledConcept, pool_concept_tables
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import list_strategies
from poolbench.records.steering import D2Record
from poolbench.scorer.artifacts import ensure_scorers
from poolbench.scorer.scorer_model import ScorerModel
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.cell_steerability import cell_steerability
from poolbench.steerer.likelihood_shift import passage_log_likelihoods
from poolbench.steerer.run import CellInputs, SteeringConfig, run_steering_cells, steering_vector
from poolbench.steerer.steerability import exact_steerability
from poolbench.steerer.steerability_check import SteerabilityVerdict, ValidationCell, steerability_verdict
from poolbench.steerer.worker import SteeringWorker
from poolbench.store.url import open_store


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
    strategies: tuple[str, ...] = field(default_factory=lambda: tuple(s.id for s in list_strategies()))


@dataclass(frozen=True)
class ValidationRun:
    model: str
    weights_hash: str
    corpus: str
    concepts: tuple[str, ...]
    cells: tuple[ValidationCell, ...]
    verdict: SteerabilityVerdict
    settings: dict
    seconds: dict[str, float]

    def to_record(self) -> dict:
        return {"model": self.model, "weights_hash": self.weights_hash, "corpus": self.corpus,
                "concepts": list(self.concepts),
                "settings": self.settings, "seconds": self.seconds, "verdict": self.verdict.to_record(),
                "cells": [c.to_record() for c in self.cells]}


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


def run_validation(model: str, corpus: str, corpus_size: str, store_url: str, settings: ValidationSettings,
                   on_line: Callable[[str], None] = print, *, worker: SteeringWorker | None = None,
                   scorers: Mapping[str, ScorerModel] | None = None) -> ValidationRun:
    """Every cell's three measures and the verdict; D2 through `settings.backend` unless `settings.d2` is off.
    `worker` and `scorers` (tests) stand in for the model named and the scorers the store trains."""
    started = time.perf_counter()
    source = open_corpus(corpus, corpus_size, list(settings.concepts) if settings.concepts else None)
    concepts = tuple(source.concepts[:settings.n_concepts] if not settings.concepts else source.concepts)
    if len(concepts) < 1:
        raise PoolBenchError(f"corpus {corpus} has no concepts to validate on")
    if worker is None:
        worker = SteeringWorker(model, backend=settings.backend if settings.d2 else "transformers")
    loaded = worker.loaded
    layers = strategy_layers(settings, loaded.n_layers)
    specs = [s for s in list_strategies() if s.id in settings.strategies]
    seconds = {"load_s": time.perf_counter() - started}
    cells: list[ValidationCell] = []
    inputs: list[CellInputs] = []
    for concept in concepts:
        t0 = time.perf_counter()
        passages = source.passages(concept)
        pooled: PooledConcept = pool_concept_tables(loaded, passages, sorted(set(layers.values())), specs,
                                                    batch_size=settings.batch_size, max_length=settings.max_length)
        test = [p for p in passages if p.split == "test"]
        texts, y = [p.text for p in test], np.array([p.label for p in test])
        base = passage_log_likelihoods(loaded, texts, batch_size=settings.batch_size, max_length=settings.max_length)
        train_texts = [p.text for p in passages if p.split == "train"]
        for spec in specs:
            layer = layers[spec.id]
            view = PooledTableView(pooled.layers[layer])
            gradients = None if pooled.layer_gradients is None else pooled.layer_gradients.get(layer)
            first = cell_steerability(view, gradients, concept, spec.id, layer)
            if first.steerability is None or first.residual_norm is None:
                cells.append(ValidationCell(concept, spec.id, layer, None, None, null_reason=first.null_reason))
                continue
            vector = steering_vector(view, concept, spec.id, layer).with_residual_norm(first.residual_norm)
            steered = passage_log_likelihoods(loaded, texts, layer=layer, delta=vector.delta(settings.alpha),
                                              batch_size=settings.batch_size, max_length=settings.max_length)
            cells.append(ValidationCell(concept, spec.id, layer, first.steerability,
                                        exact_steerability(steered, base, y, settings.alpha)))
            inputs.append(CellInputs(concept, spec.id, layer, pooled.layers[layer], train_texts, None))
        on_line(f"{concept}: pooled and scored {len(specs)} strategies in {time.perf_counter() - t0:.0f} s")
    seconds["first_order_and_exact_s"] = time.perf_counter() - started - seconds["load_s"]
    if settings.d2 and inputs:
        t0 = time.perf_counter()
        store = open_store(store_url)
        if scorers is None:
            scorers = ensure_scorers(store, source, list(concepts), allow_weak=settings.allow_weak_scorer)
        config = SteeringConfig(alphas=settings.d2_alphas, n_prompts=settings.n_prompts, seed=settings.seed,
                                prompts_file=settings.prompts_file,
                                settings=GenerationSettings(max_new_tokens=settings.max_new_tokens))
        results = run_steering_cells(store, worker, inputs, scorers, config)
        d2 = {(r.d2.concept, r.d2.strategy): r.d2 for r in results}
        cells = [c if (c.concept, c.strategy) not in d2 else ValidationCell(
            c.concept, c.strategy, c.layer, c.first_order, c.exact, d2[c.concept, c.strategy].d2_delta,
            _d2_shift(d2[c.concept, c.strategy], settings.alpha)) for c in cells]
        seconds["d2_s"] = time.perf_counter() - t0
        on_line(f"D2 on {len(inputs)} cells in {seconds['d2_s']:.0f} s")
    seconds["total_s"] = time.perf_counter() - started
    verdict = steerability_verdict(cells, settings.alpha, seed=settings.seed)
    record = {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
              for k, v in settings.__dict__.items()}
    return ValidationRun(loaded.model_id, loaded.weights_hash, f"{corpus}:{corpus_size}", concepts, tuple(cells),
                         verdict, record, {k: round(v, 1) for k, v in seconds.items()})
