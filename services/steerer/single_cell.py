"""D2/D3 for one (concept, strategy, layer) cell in this process, from a corpus and a model name alone.

What `poolbench-driver steer` runs: no D1 run is needed, since the cell's concept and its D3 neighbours are
pooled here at the one layer steered.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.corpus.source import open_corpus
from poolbench.errors import PoolBenchError
from poolbench.pooler.concept_pooling import pool_concept
from poolbench.pooler.registry import resolve_strategies
from poolbench.records.steering import SteeringResult
from poolbench.scorer.artifacts import ensure_scorers
from poolbench.store.url import open_store

from .backend import GenerationSettings
from .d3 import neighbours
from .fluency import AUTO
from .prompts import load_prompts
from .run import SteeringConfig, run_steering
from .vector import validate_alphas
from .worker import SteeringWorker


def steer_one_cell(concept: str, strategy: str, layer: int, *, model: str, corpus: str, corpus_size: str,
                   store_url: str, alphas: Sequence[float] | None = None, n_prompts: int | None = None,
                   prompts_file: str | None = None, settings: GenerationSettings | None = None,
                   fluency_guard: float = 2.0, seed: int = 0, backend: str = "transformers",
                   allow_weak_scorer: bool = False, prompt_format: str = "auto",
                   reference_model: str = AUTO) -> SteeringResult:
    """Steer one cell and score it with its own and its neighbours' scorers (its D2 and D3 records).

    Every input is checked (alphas, strategy, concept, prompts) before a model loads or a scorer trains.
    """
    grid = validate_alphas(alphas)
    if backend == "vllm":
        from .vllm_backend import require_vllm

        require_vllm()
    spec = resolve_strategies([strategy])
    nbrs = neighbours(concept)
    source = open_corpus(corpus, corpus_size)
    if concept not in source.concepts:
        raise PoolBenchError(f"concept '{concept}' is not in corpus {corpus} (has: {', '.join(source.concepts)})")
    concepts = [concept] + [c for c in nbrs.values() if c in source.concepts]
    config = SteeringConfig(alphas=grid, n_prompts=n_prompts, prompts_file=prompts_file,
                            settings=settings or GenerationSettings(), fluency_guard=fluency_guard, seed=seed,
                            prompt_format=prompt_format, reference_model=reference_model)
    load_prompts(config.prompts_file, config.n_prompts)
    store = open_store(store_url)
    scorers = ensure_scorers(store, source, concepts, allow_weak=allow_weak_scorer)
    worker = SteeringWorker(model, backend=backend)
    tables = {c: pool_concept(worker.loaded, source.passages(c), [layer], spec) for c in concepts}
    return run_steering(store, worker, concept, spec[0].id, layer, tables[concept], scorers, config,
                        train_texts=[p.text for p in source.passages(concept, "train")], neighbour_tables=tables)
