"""The driver: plan every concept's cells, run the missing ones on one Ray work queue, collect D1, then steer."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import pyarrow as pa
import ray
from ray.actor import ActorHandle

from poolbench.config import RunConfig
from poolbench.corpus.layout import Corpus
from poolbench.corpus.source import limit_passages, open_corpus, passages_digest
from poolbench.corpus.validation import validate_corpus
from poolbench.defaults import PB_PROTOCOL
from poolbench.driver.local_ray import init_local_ray
from poolbench.errors import CorpusError, PoolBenchError
from poolbench.extractor.loading import check_model_reference, local_model_dir, model_ready, weight_files
from poolbench.extractor.page_cache import read_ahead
from poolbench.pooler.concept_pooling import POOL_VERSION
from poolbench.pooler.registry import load_entry_point_strategies, load_strategy_module, resolve_strategies
from poolbench.prober.concept_probe import D1_VERSION
from poolbench.prober.flash import parse_fraction
from poolbench.prober.passage_scores import concat_scores, passage_scores_key
from poolbench.prober.pb_protocol import pb_key_fields
from poolbench.prober.reliability import RELIABILITY_VERSION
from poolbench.records.breakdowns import BucketAurocRecord, LexicalTierRecord
from poolbench.records.cluster import ClusterActivity
from poolbench.records.d1 import D1CellRecord, d1_records_from_table
from poolbench.records.events import (
    ConceptProgress,
    EventSink,
    ModelBuilding,
    PoolingRoom,
    RunPlanned,
    ignore_event,
)
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.records.run import RunOutcome
from poolbench.results.answer.tier_estimand import tier_pair_counts
from poolbench.steerer.errors import EngineDied
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key
from poolbench.store.url import open_store

from .breakdowns import d1_by_bucket, d1_by_tier, lexical_baselines, lexical_by_tier, lexical_fits
from .concept_pass import ConceptJob, ConceptPass
from .early_engines import EarlyEngines, engine_settings, start_ahead
from .extractor_fleet import ExtractorFleet
from .nodes import alive_nodes
from .probe_gate import ProbeGate, probes_beside
from .probe_tasks import probe_task_resources, reuses_probe_processes
from .ray_messages import plain_ray_messages
from .run_plan import ConceptPlan, RunInputs, RunPlan
from .steerability_stage import steerability_section
from .store_room import check_store_room, pooling_room, room_now
from .variants import MAIN, Variant, axis_variants
from .work_queue import Job, WorkQueue, fetch, poll_actors


def connect_ray(address: str | None) -> None:
    """Join a cluster (`auto` or host:port), or start a private local Ray (never a stale or foreign head)."""
    if ray.is_initialized():
        return
    plain_ray_messages()
    try:
        if address in (None, "local"):
            init_local_ray()
        else:
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as exc:
        raise PoolBenchError(f"Ray address '{address}' does not answer: {exc}".splitlines()[0]) from exc


def load_plugins(strategy_modules: Sequence[str]) -> None:
    """Installed strategy plugins and --strategy-module files register here, once, before anything resolves."""
    load_entry_point_strategies()
    for path in strategy_modules:
        load_strategy_module(path)


def check_corpus(corpus: Corpus) -> None:
    """Every hard error `validate-corpus` finds in the run's concepts stops the run here, before any model
    loads: a pair straddling train and test would leak into the held-out AUROC, a mislabelled row flips it."""
    errors = [f for f in validate_corpus(corpus.root) if f.severity == "error"
              and (f.file.split("/")[0] in corpus.concepts or "/" not in f.file)]
    if errors:
        more = f" (and {len(errors) - 1} more: run `poolbench-driver validate-corpus {corpus.root}`)" \
            if len(errors) > 1 else ""
        raise CorpusError(f"{str(errors[0]).removeprefix('error: ')}{more}")


def read_inputs(cfg: RunConfig) -> RunInputs:
    """Strategies, corpus and store as the config names them; a malformed --flash fails here too."""
    if cfg.flash is not None:
        parse_fraction(cfg.flash)
    if cfg.drop_pooled and cfg.steering:
        raise PoolBenchError("--drop-pooled: the steering stage reads the pooled vectors the drop takes; add "
                             "--no-steering (or keep them: --keep-pooled)")
    specs = resolve_strategies(list(cfg.strategies) if cfg.strategies else None)
    corpus = open_corpus(cfg.corpus, cfg.corpus_size, cfg.concepts)
    check_corpus(corpus)
    store_url = cfg.resolved_store()
    plans = [ConceptPlan(c, limit_passages(corpus.passages(c), cfg.limit, cfg.train_limit,
                                                  cfg.test_limit), corpus.concept_hash(c))
             for c in corpus.concepts]
    return RunInputs(specs, corpus, store_url, open_store(store_url), plans)


def prepare_model(cfg: RunConfig, emit: EventSink) -> None:
    """Check the model reference; convert (GGUF, the embedded SmolLM2) or train (tiny) it once, here, so the
    workers load a plain local folder, and start reading its weights into the page cache (page_cache.py)."""
    check_model_reference(cfg.model, dict(cfg.model_args))
    from poolbench.steerer.fluency import AUTO, SELF

    if cfg.steering and cfg.reference_model not in (AUTO, SELF):
        try:
            check_model_reference(cfg.reference_model)
        except PoolBenchError as exc:
            raise PoolBenchError(f"--reference-model: {exc}") from None
    if not model_ready(cfg.model):
        emit(ModelBuilding(cfg.model))
    if (folder := local_model_dir(cfg.model)) is not None:  # the extractor's first read, while Ray starts
        read_ahead(weight_files(folder))


DEFAULT_LAYER_COUNT = 6


def default_layers(n_layers: int) -> list[int]:
    """Every layer of a shallow model; for a deeper one six evenly spaced, first and last included: the D1
    layer curve is smooth between them, and every layer costs a full set of probes and reliability statistics."""
    if n_layers <= DEFAULT_LAYER_COUNT:
        return list(range(n_layers))
    return sorted({round(i * (n_layers - 1) / (DEFAULT_LAYER_COUNT - 1)) for i in range(DEFAULT_LAYER_COUNT)})


def check_store_reach(store_url: str) -> None:
    """A local-folder store on a cluster of several nodes: the other nodes' workers cannot see it (one line)."""
    nodes = alive_nodes()
    if len(nodes) > 1 and "://" not in store_url:
        raise PoolBenchError(f"--store {store_url} is a folder on this machine and the Ray cluster has {len(nodes)} "
                             "nodes whose workers cannot see it: use --store s3://BUCKET/PREFIX "
                             "(POOLBENCH_S3_ENDPOINT and AWS_* credentials are passed on to every worker)")


def plan_cells(cfg: RunConfig, inputs: RunInputs, model: dict, variant: Variant = MAIN) -> RunPlan:
    """Layers and strategies for this model, and the content-addressed keys of every concept's artifacts (at the
    variant's site and context length: the main variant's keys are those of a run without the axes)."""
    layers = (default_layers(model["n_layers"]) if cfg.layers is None
              else list(range(model["n_layers"])) if cfg.layers == "all" else list(cfg.layers))
    bad = [L for L in layers if not 0 <= L < model["n_layers"]]
    if bad:
        raise PoolBenchError(f"--layers {bad} out of range for {model['model_id']} "
                             f"({model['n_layers']} layers: 0..{model['n_layers'] - 1})")
    specs = inputs.specs
    if cfg.strategies is None and model["kind"] != "causal":
        # S2 needs a causal LM's own log-likelihood; by default an encoder runs every other strategy.
        specs = [s for s in specs if "gradient" not in s.needs]
    strategy_fps = [s.fingerprint() for s in specs]
    plans = []
    for plan in inputs.plans:
        if variant.context_length != 1:
            plan = replace(plan, passages=variant.passages(plan.passages, cfg.seed))
        pooled_key = artifact_key(
            "pooled", model=model["model_id"], weights=model["weights_hash"], dtype=model["dtype"],
            layers=layers, strategies=strategy_fps, concept=plan.concept, corpus=plan.corpus_hash,
            passages=passages_digest(plan.passages), max_length=variant.max_length(cfg.max_length),
            store_dtype=cfg.store_dtype, version=POOL_VERSION, **variant.key_fields(),
            # A 16-bit store holds S3's per-head vectors at 16 bits too (before, at float32): other bytes, another
            # key. A float32 store's bytes did not change, and neither does its key.
            **({"head_vectors": cfg.store_dtype} if cfg.store_dtype != "float32" else {}))
        d1_key = artifact_key("d1", pooled=pooled_key, n_folds=cfg.n_folds, seed=cfg.seed,
                              n_bootstrap=cfg.n_bootstrap, version=D1_VERSION,
                              reliability=RELIABILITY_VERSION if cfg.reliability else None, flash=cfg.flash,
                              **(pb_key_fields() if cfg.protocol == PB_PROTOCOL else {}))
        dump_key = artifact_key("activations", pooled=pooled_key) if cfg.dump_activations else None
        plans.append(replace(plan, pooled_key=pooled_key, d1_key=d1_key, dump_key=dump_key, variant=variant))
    return RunPlan(model, layers, specs, plans, variant)


def execute(cfg: RunConfig, run: RunPlan, inputs: RunInputs, queue: WorkQueue[ConceptJob],
            emit: EventSink, on_pooled: Callable[[], None] | None = None) -> dict[str, int]:
    """Pool the layer shards that are missing on the extractors, then probe each layer as a D1 task and gather a
    concept's layers into its D1 artifact; stored artifacts are skipped (counts are per concept). On CPU the probes
    wait for the pooling (probe_gate.py); `on_pooled` runs once the last pooling job is done."""
    on_gpu = run.on_gpu
    concepts = ConceptPass(cfg, run, inputs, emit,
                           ProbeGate[Job[ConceptJob]](beside=probes_beside(cfg, on_gpu), on_pooled=on_pooled),
                           probe_resources=probe_task_resources(on_gpu),
                           reuse_probe_processes=reuses_probe_processes(on_gpu, alive_nodes()))
    probes, to_pool = concepts.skip_stored()
    per_passage_layer = functools.cache(lambda: fetch(queue.actors[0].stored_bytes_per_passage_layer.remote(
        concepts.strategy_ids, cfg.store_dtype), "extractor"))
    if cfg.drop_pooled:
        room, free = pooling_room(inputs.store, to_pool, per_passage_layer, cfg.store_dtype)
        concepts.bound_room(None if room is None else functools.partial(room_now, inputs.store),
                            per_passage_layer() if room is not None else 0)
        emit(PoolingRoom(room, free))
    else:
        check_store_room(inputs.store, to_pool, per_passage_layer, cfg.store_dtype, steering=cfg.steering)
    concepts.group_pooling(to_pool, on_gpu, n_extractors=len(queue.actors))
    concepts.fit_to_host(queue)
    jobs = concepts.first_jobs(probes, on_gpu)
    for key, result in queue.run(jobs, concepts.after, on_wait=lambda: poll_progress(queue.actors, emit)):
        concepts.tally(key, result, node=queue.last_done_on)
    return concepts.computed


def poll_progress(actors: Sequence[ActorHandle], emit: EventSink) -> None:
    """Each busy extractor's position inside its concept, as ConceptProgress events."""
    for state in poll_actors(actors):
        group = tuple(state.get("concepts", ()))
        emit(ConceptProgress(state["concept"], state["batches"], state["passages_done"], state["passages_total"],
                             state["tokens_done"], state["seconds"], group=group if len(group) > 1 else ()))


def collect_records(store: ArtifactStore, run: RunPlan) -> list[D1CellRecord]:
    """Every concept's D1 records from the store, in concept order, whether computed now or earlier."""
    return [record for plan in run.plans for record in d1_records_from_table(store.get_table(plan.d1_key))]


def breakdowns(cfg: RunConfig, run: RunPlan, records: list[D1CellRecord], scores: pa.Table
               ) -> tuple[list[LexicalBaselineRecord], list[LexicalTierRecord], list[BucketAurocRecord]]:
    """The lexical baseline per concept and per tier (one fit a concept for both) and D1 by density / placement:
    seconds, no model, so never cached."""
    passages = {p.concept: p.passages for p in run.plans}
    fits = lexical_fits(passages)
    return (lexical_baselines(passages, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed, fits=fits),
            lexical_by_tier(passages, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed, fits=fits),
            d1_by_bucket(scores, passages, records, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed))


def outcome_of(cfg: RunConfig, inputs: RunInputs, run: RunPlan, records: list[D1CellRecord],
               computed: dict[str, int],
               timing: dict[str, float], steering: dict | None) -> RunOutcome:
    """The run as results.json reports it: cells plus where every number came from."""
    corpus = inputs.corpus
    return RunOutcome(
        config=cfg, model=run.model,
        corpus={"source": cfg.corpus, "root": str(corpus.root), "size": cfg.corpus_size, "hash": corpus.hash,
                "concept_hashes": {p.concept: p.corpus_hash for p in run.plans},
                "passages": {p.concept: len(p.passages) for p in run.plans},
                "tier_pairs": tier_pair_counts({p.concept: p.passages for p in run.plans})},
        layers=run.layers, strategies=[s.fingerprint() | {"family": s.family, "description": s.description,
                                                           "supervision": s.supervision, "needs": sorted(s.needs),
                                                           "variant_of": s.variant_of,
                                                           "reference_variant": s.reference_variant}
                                       for s in run.specs],
        records=records,
        artifacts={p.concept: {"pooled": None if cfg.drop_pooled else p.pooled_key, "d1": p.d1_key,
                               "passage_scores": passage_scores_key(p.d1_key)} for p in run.plans},
        computed=computed, timing=timing, store=inputs.store.describe(), steering=steering,
    )


def run_benchmark(cfg: RunConfig, on_event: EventSink | None = None, strategy_modules: tuple[str, ...] = (),
                  fleet: ExtractorFleet | None = None) -> RunOutcome:
    """Plan every concept's cells, compute only the missing artifacts, collect the D1 records, then steer; a
    `fleet` (a run over several models) lends its workers, which load this model in place of the last."""
    with EarlyEngines() as early:  # steering engines started as the pooling ends, killed when the run closes
        return _benchmark(cfg, on_event, strategy_modules, fleet, early)


def _benchmark(cfg: RunConfig, on_event: EventSink | None, strategy_modules: tuple[str, ...],
               fleet: ExtractorFleet | None, early: EarlyEngines) -> RunOutcome:
    emit = on_event or ignore_event
    started = time.perf_counter()
    load_plugins(strategy_modules)
    if cfg.steering and cfg.backend == "vllm":
        from poolbench.steerer.vllm_backend import require_vllm

        require_vllm()  # one line with the install hint now, not after D1 inside a steering actor
    inputs = read_inputs(cfg)
    prepare_model(cfg, emit)
    connect_ray(cfg.address)
    check_store_reach(inputs.store_url)
    with contextlib.ExitStack() as stack:  # a fleet of the run's own is killed however the run stops
        workers = fleet if fleet is not None else stack.enter_context(ExtractorFleet(strategy_modules))
        with workers.queue(cfg, len(inputs.plans), emit) as queue:
            run = plan_cells(cfg, inputs, fetch(queue.actors[0].info.remote(), "extractor start"))
            emit(RunPlanned(
                model_id=run.model["model_id"], n_layers=run.model["n_layers"],
                hidden_size=run.model["hidden_size"], concepts=tuple(p.concept for p in run.plans),
                layers=tuple(run.layers), strategies=tuple(s.id for s in run.specs),
                worker_pids=tuple(fetch(ref, "extractor start") for ref in [w.pid.remote() for w in queue.actors]),
                variants=(MAIN.name, *[v.name for v in axis_variants(cfg)])))
            axes = [plan_cells(cfg, inputs, run.model, variant) for variant in axis_variants(cfg)]
            # The run's own extractors leave once its last pooling is done: their cores go to the probe tasks, and
            # on a CPU the steering engines start beside them (early_engines.py).
            retire = early.after(lambda: workers.retire(queue), start_ahead(cfg, run.on_gpu),
                                 lambda: engine_settings(cfg, workers.threads)) if fleet is None else None
            computed = execute(cfg, run, inputs, queue, emit, on_pooled=None if axes else retire)
            for axis in axes:  # each other site and context length: one more pooling and probing pass
                last = retire if axis is axes[-1] else None
                for name, count in execute(cfg, axis, inputs, queue, emit, on_pooled=last).items():
                    computed[f"{name}_{axis.variant.name}"] = count
        if cfg.steering:
            workers.release()  # steering's actors want the extractors' GPUs and cores
    threads = workers.threads
    cluster = ClusterActivity().merged("pool", queue.done_on, queue.lost_nodes, queue.retried)
    records = collect_records(inputs.store, run)
    axis_records = [axis.variant.tag(record) for axis in axes for record in collect_records(inputs.store, axis)]
    scores = concat_scores([inputs.store.get_table(passage_scores_key(p.d1_key)) for p in run.plans])
    lexical, lexical_tiers, buckets = breakdowns(cfg, run, records, scores)
    passages = {p.concept: p.passages for p in run.plans}
    d1_tiers = d1_by_tier(scores, passages, records, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
    steerability = None if cfg.drop_pooled else steerability_section(  # it reads the dropped vectors
        inputs.store, {p.concept: p.pooled_key for p in run.plans}, records, seed=cfg.seed,
        weights_hash=run.model.get("weights_hash"))
    timing = {"d1_s": time.perf_counter() - started}
    steering, steering_error = None, ""
    if cfg.steering:
        try:
            from poolbench.driver.steering_stage import steer

            steering = steer(cfg, inputs, run, records, threads, emit, early.take())
        except EngineDied as exc:  # the engine died twice: the run's D1 stands, its steering stage failed
            steering_error = str(exc).splitlines()[0]
    if steering is not None:
        timing["steering_s"] = steering["timing"]["total_s"]
        if "engine_start_s" in steering["timing"]:  # the slowest vLLM engine's start-up (compile, capture)
            timing["steering_engine_start_s"] = steering["timing"]["engine_start_s"]
        cluster = cluster.joined(steering.pop("cluster"))
    timing["total_s"] = time.perf_counter() - started
    return replace(outcome_of(cfg, inputs, run, records, computed, timing, steering), lexical=lexical,
                   d1_buckets=buckets, d1_tiers=d1_tiers, lexical_tiers=lexical_tiers, steering_error=steering_error,
                   cluster=cluster, passage_scores=scores, steerability=steerability, axis_records=axis_records,
                   axis_artifacts={axis.variant.name: {p.concept: {"pooled": None if cfg.drop_pooled
                                                                   else p.pooled_key, "d1": p.d1_key}
                                                       for p in axis.plans} for axis in axes})
