"""The endpoints' work on the compute thread: a batch of /pool, /score or /generate requests, or one /probe, each
answered as it would be alone; a bad request fails alone, never the batch it shares."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from poolbench.errors import PoolBenchError
from poolbench.http.batching import answer_grouped
from poolbench.http.model_caches import ModelCache, ScorerCache, SteeringEngines, VectorCache
from poolbench.http.schemas import (
    GenerateRequest,
    GenerateResponse,
    GenerationOut,
    PoolRequest,
    PoolResponse,
    ProbeRequest,
    ProbeResponse,
    ProbeScores,
    ScoreRequest,
    ScoreResponse,
)
from poolbench.http.service_errors import RequestError
from poolbench.http.settings import ServiceSettings
from poolbench.http.text_pooling import pool_texts, strategy_spec

if TYPE_CHECKING:  # loaded lazily: importing the app loads no steering code
    from poolbench.steerer.generation_rows import GenerationRow


def check_sizes(settings: ServiceSettings, texts: list[str], what: str) -> None:
    """Refuse a request over the text limits before it waits for the compute thread, naming the first entry over."""
    if len(texts) > settings.max_texts:
        raise RequestError(f"{what}: {len(texts)} entries, at most {settings.max_texts} per request")
    long = [i for i, t in enumerate(texts) if len(t) > settings.max_chars]
    if long:
        raise RequestError(f"{what}[{long[0]}]: {len(texts[long[0]])} characters, at most {settings.max_chars}")



def pool_many(reqs: list[PoolRequest], *, settings: ServiceSettings, models: ModelCache
              ) -> list[PoolResponse | PoolBenchError]:
    """A batch of /pool requests under one hold of each model's lock, one thread hop for all. Each request keeps
    its own forward pass: pooling texts of several requests together changes their vectors (padding; by up to
    0.06 in the embedded model's bfloat16, 1.5e-4 in float32), and an answer must not depend on its neighbours."""
    from poolbench.pooler.pooled_table import PooledTableView

    def answer(loaded, group: list[PoolRequest]) -> list[PoolResponse | PoolBenchError]:
        out: list[PoolResponse | PoolBenchError] = []
        for req in group:
            started, n = time.perf_counter(), len(req.texts)
            try:
                strategy = strategy_spec(req.strategy).id
                table = pool_texts(loaded, settings, req.texts, [0] * n, ["test"] * n, [None] * n, req.layer,
                                   strategy).pooled
            except PoolBenchError as exc:
                out.append(exc)
                continue
            cell = PooledTableView(table).matrix(req.layer, strategy)
            order = np.argsort([int(p[1:]) for p in cell.passage_ids])
            out.append(PoolResponse(model_id=loaded.model_id, layer=req.layer, strategy=strategy,
                                    dim=int(cell.X.shape[1]), vectors=cell.X[order].astype(float).tolist(),
                                    fallback=cell.fallback[order].tolist(), seconds=time.perf_counter() - started))
        return out

    return answer_grouped(reqs, lambda r: r.model, models.use, answer)



def probe_one(req: ProbeRequest, *, settings: ServiceSettings, models: ModelCache) -> ProbeResponse:
    """D1 of one cell on labelled texts: the batch pipeline's pooling and probe, without the reliability statistics."""
    from poolbench.prober.concept_probe import probe_pooled_table

    check_sizes(settings, [i.text for i in req.items], "items")
    if req.n_bootstrap > settings.max_bootstrap:
        raise RequestError(f"n_bootstrap: {req.n_bootstrap}, at most {settings.max_bootstrap}")
    spec = strategy_spec(req.strategy)
    started = time.perf_counter()
    items = req.items
    with models.use(req.model) as loaded:
        pooled = pool_texts(loaded, settings, [i.text for i in items], [i.label for i in items],
                            [i.split for i in items], [i.group for i in items], req.layer, spec.id)
    # The reliability statistics are not part of the answer, so they are not computed.
    records = probe_pooled_table(pooled.pooled, "http", n_folds=req.n_folds, seed=req.seed,
                                 n_bootstrap=req.n_bootstrap, reliability=False, heads=pooled.heads)
    keep = set(ProbeScores.model_fields)
    return ProbeResponse(model_id=loaded.model_id, layer=req.layer, strategy=spec.id,
                         probes={r.probe: {k: getattr(r, k) for k in keep} for r in records},
                         seconds=time.perf_counter() - started)



def score_many(reqs: list[ScoreRequest], *, scorers: ScorerCache) -> list[ScoreResponse | PoolBenchError]:
    """A batch of /score requests under one hold of each scorer's lock; each request scored on its own, as its
    answer alone would be (the scorer pads by length within a call)."""
    def answer(scorer, group: list[ScoreRequest]) -> list[ScoreResponse]:
        return [ScoreResponse(concept=req.concept, scores=scorer.score(req.texts).tolist(),
                              heldout_auroc=scorer.info.get("heldout_auroc")) for req in group]

    return answer_grouped(reqs, lambda r: r.concept, scorers.use, answer)



def request_rows(req: GenerateRequest, loaded, vectors: VectorCache) -> list[GenerationRow]:
    """A /generate request as generation rows (prompt i with the request's delta, layer and seed + i), or one line
    naming what is wrong with it, checked on its own so it never fails a batch it shares."""
    import torch

    from poolbench.steerer.backend import validate_deltas
    from poolbench.steerer.generation_rows import GenerationRow

    if req.layer >= loaded.n_layers:
        raise RequestError(f"layer: {req.layer} out of range for '{loaded.model_id}' ({loaded.n_layers} layers)")
    delta = None
    if req.vector is not None and req.alpha != 0:
        if len(req.vector) != loaded.hidden_size:
            raise RequestError(f"vector: {len(req.vector)} floats, the model's hidden size is {loaded.hidden_size}")
        delta = req.alpha * np.asarray(req.vector, dtype=np.float64)
    if req.stored is not None and req.alpha != 0:
        stored = vectors.get(req.stored, req.layer)
        if stored.size != loaded.hidden_size:
            raise RequestError(f"stored: the run's vector has {stored.size} dimensions, model "
                               f"'{loaded.model_id}' has {loaded.hidden_size}")
        delta = req.alpha * np.asarray(stored, dtype=np.float64)
    validate_deltas([delta], loaded.hidden_size, torch.finfo(loaded.dtype).max)
    return [GenerationRow(p, delta, req.seed + i, req.layer) for i, p in enumerate(req.prompts)]



def generate_many(reqs: list[GenerateRequest], *, models: ModelCache, engines: SteeringEngines,
                  vectors: VectorCache) -> list[GenerateResponse | PoolBenchError]:
    """A batch of /generate requests: per model and generation settings, every request's rows in one engine call
    (steerer.generation_rows: rows with different vectors and layers side by side, identical rows once)."""
    from poolbench.steerer.backend import GenerationSettings
    from poolbench.steerer.generation_rows import generate_groups

    def answer(loaded, group: list[GenerateRequest]) -> list[GenerateResponse | PoolBenchError]:
        out: list[GenerateResponse | PoolBenchError | None] = [None] * len(group)
        calls: dict[GenerationSettings, list[tuple[int, list[GenerationRow]]]] = {}
        for i, req in enumerate(group):
            gen = GenerationSettings(max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                     greedy=req.greedy)
            try:
                calls.setdefault(gen, []).append((i, request_rows(req, loaded, vectors)))
            except PoolBenchError as exc:
                out[i] = exc
        for gen, batch in calls.items():
            try:
                answers = generate_groups(engines.backend(group[0].model, loaded), [rows for _, rows in batch], gen)
            except PoolBenchError as exc:
                for i, _ in batch:
                    out[i] = exc
                continue
            for (i, _), gens in zip(batch, answers, strict=True):
                out[i] = GenerateResponse(model_id=loaded.model_id, layer=group[i].layer, alpha=group[i].alpha,
                                          generations=[GenerationOut(prompt=g.prompt, text=g.text) for g in gens])
        return out  # type: ignore[return-value]

    return answer_grouped(reqs, lambda r: r.model, models.use, answer)
