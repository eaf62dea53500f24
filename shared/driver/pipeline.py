"""The driver's plan: cells per concept (pool, then D1), fanned out on Ray, skipping artifacts already stored."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from poolbench.config import EMBEDDED, RunConfig
from poolbench.corpus.passage import Passage
from poolbench.corpus.source import limit_passages, open_corpus, passages_digest
from poolbench.errors import PoolBenchError
from poolbench.extractor.embedded_model import embedded_model_ready, ensure_embedded_model
from poolbench.extractor.loading import check_model_reference
from poolbench.pooler.concept_pooling import POOL_VERSION
from poolbench.pooler.registry import load_entry_point_strategies, load_strategy_module, resolve_strategies
from poolbench.pooler.worker import ExtractorWorker
from poolbench.prober.concept_probe import D1_VERSION, probe_concept_task
from poolbench.prober.flash import parse_fraction
from poolbench.prober.reliability import RELIABILITY_VERSION
from poolbench.records.run import RunOutcome
from poolbench.store.keys import artifact_key
from poolbench.store.url import open_store

FORWARDED_ENV = ("POOLBENCH_CACHE", "POOLBENCH_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_REGION", "HF_HOME", "HF_HUB_OFFLINE")


@dataclass
class ConceptPlan:
    concept: str
    passages: list[Passage]
    corpus_hash: str
    pooled_key: str = ""
    d1_key: str = ""
    dump_key: str | None = None


Event = Callable[[str, dict], None]


def connect_ray(address: str | None) -> None:
    """Join a cluster (`auto` or host:port), or start a private local Ray (never a stale or foreign head)."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as exc:
        raise PoolBenchError(f"Ray address '{address}' does not answer: {exc}".splitlines()[0]) from exc


def worker_runtime_env() -> dict:
    """The store's endpoint and credentials (and the cache) as the driver sees them now, for every worker."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    return {"env_vars": env} if env else {}


def _plan_workers(cfg: RunConfig, n_jobs: int) -> tuple[int, dict, int | None]:
    """One worker per GPU on a GPU cluster; on CPU, workers share the cores (threads split between them)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus and cfg.device != "cpu":
        return max(1, min(gpus, n_jobs, cfg.num_workers or gpus)), {"num_gpus": 1, "num_cpus": 1}, None
    cpus = max(1, int(ray.cluster_resources().get("CPU", os.cpu_count() or 1)))
    workers = max(1, min(cfg.num_workers or 1, n_jobs))
    threads = cfg.torch_threads or max(1, cpus // workers)
    return workers, {"num_cpus": 1}, threads


def run_benchmark(cfg: RunConfig, on_event: Event | None = None,
                  strategy_modules: tuple[str, ...] = ()) -> RunOutcome:
    """Plan every concept's cells, compute only the missing artifacts, and collect the D1 records."""
    emit = on_event or (lambda kind, data: None)
    started = time.perf_counter()
    if cfg.flash is not None:
        parse_fraction(cfg.flash)  # a malformed fraction fails here, in one line, before any work
    load_entry_point_strategies()
    for path in strategy_modules:
        load_strategy_module(path)
    specs = resolve_strategies(list(cfg.strategies) if cfg.strategies else None)
    corpus = open_corpus(cfg.corpus, cfg.corpus_size, cfg.concepts)
    store_url = cfg.resolved_store()
    store = open_store(store_url)
    plans = [ConceptPlan(c, limit_passages(corpus.passages(c), cfg.limit), corpus.concept_hash(c))
             for c in corpus.concepts]

    check_model_reference(cfg.model, dict(cfg.model_args))
    if cfg.model == EMBEDDED:
        emit("model", {"building": not embedded_model_ready()})
        ensure_embedded_model()  # once, here: workers then load it like any local model
    connect_ray(cfg.address)
    worker_cls = ray.remote(max_restarts=2, max_task_retries=2)(ExtractorWorker)
    n_workers, resources, threads = _plan_workers(cfg, len(plans))
    runtime_env = worker_runtime_env()
    workers = [worker_cls.options(**resources, runtime_env=runtime_env).remote(  # type: ignore[attr-defined]
        cfg.model, dtype=cfg.dtype, device=cfg.device, model_args=dict(cfg.model_args),
        torch_threads=threads, strategy_modules=strategy_modules) for _ in range(n_workers)]
    try:
        model = ray.get(workers[0].info.remote())
        layers = list(cfg.layers) if cfg.layers is not None else list(range(model["n_layers"]))
        bad = [L for L in layers if not 0 <= L < model["n_layers"]]
        if bad:
            raise PoolBenchError(f"--layers {bad} out of range for {model['model_id']} "
                                 f"({model['n_layers']} layers: 0..{model['n_layers'] - 1})")
        if cfg.strategies is None and model["kind"] != "causal":
            # S2 needs a causal LM's own log-likelihood; by default an encoder runs every other strategy.
            specs = [s for s in specs if "gradient" not in s.needs]
        strategy_fps = [s.fingerprint() for s in specs]
        for plan in plans:
            plan.pooled_key = artifact_key(
                "pooled", model=model["model_id"], weights=model["weights_hash"], dtype=model["dtype"],
                layers=layers, strategies=strategy_fps, concept=plan.concept, corpus=plan.corpus_hash,
                passages=passages_digest(plan.passages), max_length=cfg.max_length, version=POOL_VERSION)
            plan.d1_key = artifact_key("d1", pooled=plan.pooled_key, n_folds=cfg.n_folds, seed=cfg.seed,
                                       n_bootstrap=cfg.n_bootstrap, version=D1_VERSION,
                                       reliability=RELIABILITY_VERSION if cfg.reliability else None,
                                       flash=cfg.flash)
            if cfg.dump_activations:
                plan.dump_key = artifact_key("activations", pooled=plan.pooled_key)
        emit("plan", {"concepts": [p.concept for p in plans], "layers": layers, "strategies": [s.id for s in specs],
                      "model": model, "workers": n_workers, "worker_pids": ray.get([w.pid.remote() for w in workers])})

        computed = {"pooled": 0, "d1": 0, "pooled_skipped": 0, "d1_skipped": 0}
        pending_probe: dict[ray.ObjectRef, ConceptPlan] = {}
        pending_pool: dict[ray.ObjectRef, tuple[ConceptPlan, ray.actor.ActorHandle]] = {}
        probe_task = ray.remote(max_retries=2)(probe_concept_task)

        def submit_probe(plan: ConceptPlan) -> None:
            if store.exists(plan.d1_key):
                computed["d1_skipped"] += 1
                emit("probed", {"concept": plan.concept, "skipped": True})
                return
            ref = probe_task.options(num_cpus=1, runtime_env=runtime_env).remote(
                store_url, plan.pooled_key, plan.d1_key, plan.concept, cfg.n_folds, cfg.seed, cfg.n_bootstrap,
                cfg.reliability, cfg.flash)
            pending_probe[ref] = plan

        metadata = {"model": model["model_id"], "weights_hash": model["weights_hash"]}
        queue = []
        for plan in plans:
            needs_dump = plan.dump_key is not None and not store.exists(plan.dump_key)
            if store.exists(plan.pooled_key) and not needs_dump:
                computed["pooled_skipped"] += 1
                emit("pooled", {"concept": plan.concept, "skipped": True})
                submit_probe(plan)
            else:
                queue.append(plan)
        idle = list(workers)
        while queue or pending_pool or pending_probe:
            while queue and idle:
                plan, worker = queue.pop(0), idle.pop(0)
                ref = worker.pool_concept.remote(
                    plan.concept, plan.passages, layers, [s.id for s in specs], store_url=store_url,
                    key=plan.pooled_key, metadata={**metadata, "concept": plan.concept, "corpus": plan.corpus_hash},
                    batch_size=cfg.batch_size, max_length=cfg.max_length, dump_key=plan.dump_key,
                    max_batch_tokens=cfg.max_batch_tokens)
                pending_pool[ref] = (plan, worker)
            ready, _ = ray.wait(list(pending_pool) + list(pending_probe), num_returns=1)
            ref = ready[0]
            if ref in pending_pool:
                plan, worker = pending_pool.pop(ref)
                idle.append(worker)
                summary = ray.get(ref)
                computed["pooled"] += 1
                emit("pooled", {"concept": plan.concept, "skipped": False, **summary})
                submit_probe(plan)
            else:
                plan = pending_probe.pop(ref)
                summary = ray.get(ref)
                computed["d1"] += 1
                emit("probed", {"concept": plan.concept, "skipped": False, **summary})
    finally:  # a failed or interrupted run leaves no actor holding a model (or a GPU) behind
        for worker in workers:
            ray.kill(worker)
    records = []
    for plan in plans:
        records.extend(store.get_table(plan.d1_key).to_pylist())
    timing = {"d1_s": time.perf_counter() - started}
    steering = None
    if cfg.steering:
        from poolbench.driver.steering_stage import run_steering_on_ray
        from poolbench.results.leaderboard import build_leaderboard

        steering = run_steering_on_ray(
            store, store_url, corpus, {p.concept: p.pooled_key for p in plans}, build_leaderboard(records),
            model=cfg.model, backend=cfg.backend, runtime_env=runtime_env, full=cfg.full,
            allow_weak_scorer=cfg.allow_weak_scorer,
            worker_args={"dtype": cfg.dtype, "device": cfg.device, "model_args": dict(cfg.model_args),
                         "torch_threads": threads},
            emit=emit)
        timing["steering_s"] = steering["timing"]["total_s"]
    timing["total_s"] = time.perf_counter() - started
    return RunOutcome(
        config=cfg, model=model,
        corpus={"source": cfg.corpus, "root": str(corpus.root), "size": cfg.corpus_size, "hash": corpus.hash,
                "concept_hashes": {p.concept: p.corpus_hash for p in plans},
                "passages": {p.concept: len(p.passages) for p in plans}},
        layers=layers, strategies=[s.fingerprint() | {"family": s.family, "description": s.description,
                                                       "supervision": s.supervision, "needs": sorted(s.needs),
                                                       "variant_of": s.variant_of,
                                                       "reference_variant": s.reference_variant}
                                   for s in specs],
        records=records,
        artifacts={p.concept: {"pooled": p.pooled_key, "d1": p.d1_key} for p in plans},
        computed=computed, timing=timing, store=store.describe(), steering=steering,
    )
