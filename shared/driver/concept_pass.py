"""One pooling-and-probing pass over a run plan's concepts on the work queue: what is stored is skipped, the rest is
grouped into pooling jobs fitted to the extractors' host memory (host_room.py), and each finished job's concepts
go on to their D1 probes (through the probe gate) and are counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ray

from poolbench.config import RunConfig
from poolbench.driver.pool_groups import estimated_tokens, group_token_target, plan_groups
from poolbench.pooler.concept_pooling import strategy_needs
from poolbench.pooler.parse_task import parse_concept_task
from poolbench.pooler.pooled_drop import drop_pooled, pooled_keys
from poolbench.pooler.pooled_table import write_pooled_manifest
from poolbench.pooler.spec import StrategySpec
from poolbench.pooler.worker import PoolTask
from poolbench.prober.concept_probe import gather_layer_d1
from poolbench.prober.passage_scores import passage_scores_key
from poolbench.records.events import (
    ArtifactQuarantined,
    ConceptPooled,
    ConceptProbed,
    EventSink,
    LayerProbed,
    PoolingFitted,
)
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore

from .extractor_fleet import worker_runtime_env
from .host_room import VectorBytes, extractor_budget, fit_host_room
from .probe_gate import ProbeGate, beside_the_forward
from .probe_tasks import probe_task_function
from .room_gate import RoomGate
from .run_plan import ConceptPlan, PoolGroup, RunInputs, RunPlan
from .variants import RESIDUAL
from .work_queue import ActorJob, Job, TaskJob, WorkQueue, fetch


@dataclass(frozen=True)
class ConceptJob:
    """A work-queue key: pool the missing layers of a concept (or of a group of concepts sharing forwards, named
    in `group`) on an extractor, or probe one layer (D1) of a concept in a task."""

    stage: str
    concept: str
    layer: int | None = None
    group: tuple[str, ...] = ()

    @property
    def concepts(self) -> tuple[str, ...]:
        return self.group or (self.concept,)

    def __str__(self) -> str:
        return f"{self.stage} {'+'.join(self.concepts)}" + (f" layer {self.layer}" if self.layer is not None else "")


class ConceptPass:
    """One pooling-and-probing pass over a run plan's concepts on the work queue, in named stages (skip what is
    stored, group the pooling, fit it to the hosts' memory, start, follow each finished job, tally), and the state
    those stages share."""

    def __init__(self, cfg: RunConfig, run: RunPlan, inputs: RunInputs, emit: EventSink,
                 gate: ProbeGate[Job[ConceptJob]], probe_resources: dict | None = None,
                 reuse_probe_processes: bool = True) -> None:
        self.cfg, self.run, self.inputs, self.emit, self.gate = cfg, run, inputs, emit, gate
        self.probe_resources = probe_resources or {"num_cpus": 1}
        self.computed = {"pooled": 0, "d1": 0, "pooled_skipped": 0, "d1_skipped": 0}
        self.plans = {p.concept: p for p in run.plans}
        self.probe_task = probe_task_function(reuse_probe_processes)
        self.parse_task = ray.remote(max_retries=2)(parse_concept_task)
        self.runtime_env = worker_runtime_env()
        self.metadata = {"model": run.model["model_id"], "weights_hash": run.model["weights_hash"],
                         **{name: str(value) for name, value in run.variant.key_fields().items()}}
        self.strategy_ids = [s.id for s in run.specs]
        self.unprobed: dict[str, set[int]] = {}  # concept -> its layers whose probe task has not come back
        self.groups: list[PoolGroup] = []
        self.unparsed: set[str] = set()  # concepts whose parse task runs
        self.unsent: list[int] = []  # groups waiting for their concepts' parses
        self.passes_left: dict[str, int] = {}  # concept -> its pooling passes not yet done (host_room.py)
        self.pass_seconds: dict[str, float] = {}
        self.submitted: dict[ConceptJob, float] = {}  # a probe task -> when it was submitted (perf_counter)
        # --drop-pooled: pooling jobs start within the store's room (room_gate.py); unbounded otherwise
        self.drop = cfg.drop_pooled
        self.room: RoomGate[Job[ConceptJob]] = RoomGate(None)
        self.per_passage_layer = 0  # bytes of vectors a passage and layer stores (set with a bounded room)
        self.pools_running = 0  # pooling jobs started and not yet done
        self.released: list[Job[ConceptJob]] = []  # pooling jobs the room let start, for the next follow-up

    def skip_stored(self) -> tuple[list[Job[ConceptJob]], PoolGroup]:
        """Stage 1: a concept whose pooled shards are all stored goes straight to its probes (none where its D1
        is stored too); the others, with their missing layers, wait for pooling. With --drop-pooled a layer whose
        D1 is stored needs no shard (its shard was dropped, or will be), and the manifest is never written (the
        drop would take it at once)."""
        cfg, run = self.cfg, self.run
        jobs: list[Job[ConceptJob]] = []
        to_pool: PoolGroup = []
        for plan in run.plans:
            needs_dump = plan.dump_key is not None and not self.stored(plan.dump_key)
            missing = list(run.layers) if needs_dump else [layer for layer in self.layers_to_probe(plan)
                                                            if not self.stored(layer_shard_key(plan.pooled_key, layer))]
            if missing:
                to_pool.append((plan, missing))
                continue
            if not self.drop and not self.stored(plan.pooled_key):  # every shard landed but not the manifest
                write_pooled_manifest(self.inputs.store, plan.pooled_key, run.layers, cfg.store_dtype)
            self.computed["pooled_skipped"] += 1
            self.emit(ConceptPooled(plan.concept, skipped=True))
            jobs.extend(self.probe_unless_stored(plan))
        return jobs, to_pool

    def layers_to_probe(self, plan: ConceptPlan) -> list[int]:
        """The run's layers, or with --drop-pooled those whose D1 is not stored (a concept whose D1 is stored
        needs none)."""
        if not self.drop:
            return list(self.run.layers)
        if self.stored(plan.d1_key):
            return []
        return [layer for layer in self.run.layers if not self.stored(layer_shard_key(plan.d1_key, layer))]

    def bound_room(self, room: Callable[[], int] | None, per_passage_layer: int) -> None:
        """Stage 1b (--drop-pooled): the pooling starts jobs within `room()`, the bytes its files may take now."""
        self.room, self.per_passage_layer = RoomGate(room), per_passage_layer

    def group_pooling(self, to_pool: PoolGroup, on_gpu: bool, n_extractors: int) -> None:
        """Stage 2: the concepts to pool, grouped so that a group's passages share forwards (pool_groups.py); with
        a bounded room, a group larger than the room is pooled one concept a job."""
        cfg = self.cfg
        target = 0 if cfg.dump_activations else group_token_target(cfg.concept_group_tokens, on_gpu,
                                                                    cfg.max_batch_tokens)
        sizes = [estimated_tokens(plan.passages, cfg.max_length) for plan, _ in to_pool]
        room = self.room.room() if self.room.room is not None else None
        for group in plan_groups(sizes, target, n_extractors):
            members = [to_pool[i] for i in group]
            if room is not None and sum(self.vector_bytes(members).values()) > room:
                self.groups.extend([member] for member in members)
            else:
                self.groups.append(members)

    def vector_bytes(self, group: PoolGroup) -> dict[str, int]:
        """The bytes of vectors a pooling job stores for each of its concepts (0 where the room is not counted)."""
        return {plan.concept: self.per_passage_layer * len(plan.passages) * len(layers) for plan, layers in group}

    def fit_to_host(self, queue: WorkQueue[ConceptJob]) -> None:
        """Stage 2b: the jobs, and how many an extractor holds at once, fitted to the memory of the extractors'
        hosts (host_room.py); what was cut is said in one event. An activation dump's concept is pooled whole
        (its dump holds every layer of its one job), as before."""
        if not self.groups or not queue.actors or self.cfg.dump_activations:
            return
        rooms = [fetch(ref, "extractor") for ref in [actor.host_room.remote() for actor in queue.actors]]
        held, copied = fetch(queue.actors[0].host_bytes_per_passage_layer.remote(
            self.strategy_ids, self.cfg.store_dtype, self.inputs.store.buffers_tables), "extractor")
        plan = fit_host_room(self.groups, VectorBytes(held, copied), extractor_budget(rooms), queue.slots)
        self.groups, queue.slots = plan.groups, plan.slots
        self.passes_left = dict(plan.passes)
        if plan.steps:
            self.computed["pooled_in_passes"] = len(plan.passes)
            self.emit(PoolingFitted(plan.steps, plan.budget))

    def first_jobs(self, probes: list[Job[ConceptJob]], on_gpu: bool) -> list[Job[ConceptJob]]:
        """Stage 3: the queue's first jobs: each group's parses (spaCy on the CPU cores while the GPU pools the
        groups before) or its pooling, before the probes of concepts pooled earlier, which the gate may hold."""
        jobs = self.gate.start(len(self.groups), probes)  # probes of concepts pooled before wait for this pooling too
        if parse_ahead(self.cfg, self.run.specs, on_gpu):
            concepts = dict.fromkeys(plan.concept for group in self.groups for plan, _ in group)  # once, in order
            self.unparsed, self.unsent = set(concepts), list(range(len(self.groups)))
            jobs[:0] = [self.parse(self.plans[concept]) for concept in concepts]
        else:
            jobs[:0] = self.start_pooling(self.groups)
        return jobs

    def start_pooling(self, groups: list[PoolGroup]) -> list[Job[ConceptJob]]:
        """The pooling jobs of these groups that the store's room lets start now; the others wait for a drop."""
        jobs = [job for group in groups for job in self.room.admit(self.vector_bytes(group), self.pool(group))]
        self.pools_running += len(jobs)
        return jobs

    def after(self, key: ConceptJob, _: list[dict] | dict) -> list[Job[ConceptJob]]:
        """Stage 4, the queue's follow-ups: a group's pooling once every one of its concepts is parsed (and the
        store has room for it); a pooled concept's probes (through the gate); the pooling a dropped concept's room
        lets start. Where the pooling waits for room and none runs, the gate's held probes start: only they free
        it."""
        jobs, self.released = self.released, []
        if key.stage == "parse":
            self.unparsed.discard(key.concept)
            ready = [g for g in self.unsent if not any(plan.concept in self.unparsed for plan, _ in self.groups[g])]
            self.unsent = [g for g in self.unsent if g not in ready]
            return jobs + self.start_pooling([self.groups[g] for g in ready])
        if key.stage != "pool":
            return jobs + self.unstall(jobs)
        self.pools_running -= 1
        jobs += self.gate.pooled(job for concept in key.concepts if not self.passes_left.get(concept)
                                 for job in self.probe_unless_stored(self.plans[concept]))
        if self.pools_running == 0 and self.room.waiting:
            jobs += self.gate.flush()
        return jobs + self.unstall(jobs)

    def unstall(self, starting: list[Job[ConceptJob]]) -> list[Job[ConceptJob]]:
        """The waiting pooling job, forced (room_gate.py), where nothing runs that could free room: no pooling,
        no probe task, no parse task, nothing starting."""
        probing = any(self.unprobed.values())
        if starting or self.pools_running or probing or self.unparsed or not self.room.waiting:
            return []
        forced = self.room.force()
        self.pools_running += len(forced)
        return forced

    def tally(self, key: ConceptJob, result: list[dict] | dict, node: str) -> None:
        """Stage 5, each finished job counted and reported; a concept's D1 gathered once its last layer is probed."""
        computed = self.computed
        if key.stage == "parse":
            computed["parsed_ahead"] = computed.get("parsed_ahead", 0) + int(result["parsed"])
        elif key.stage == "pool":
            for summary in result:  # one per concept of the job
                self.measure_room(summary["concept"])
                if not self.last_pass(summary):
                    continue
                computed["pooled"] += 1
                if summary.get("skipped_passages"):  # left out: they did not fit the device even alone (logged)
                    computed["passages_too_big"] = (computed.get("passages_too_big", 0)
                                                    + len(summary["skipped_passages"]))
                seconds = self.pass_seconds.pop(summary["concept"], summary["seconds"])  # a split one's passes
                self.emit(ConceptPooled(summary["concept"], skipped=False, seconds=seconds, node=node))
        else:
            wall = time.perf_counter() - self.submitted.pop(key)
            self.emit(LayerProbed(key.concept, int(result["layer"]), int(result["cells"]), result["read_s"],
                                  result["probe_s"], result["write_s"], node=node, wall_s=wall, pid=result["pid"],
                                  earlier_tasks=result["earlier_tasks"], devices=result["devices"]))
            left = self.unprobed[key.concept]
            left.discard(int(result["layer"]))
            if not left:
                self.gather(self.plans[key.concept])

    def last_pass(self, summary: dict) -> bool:
        """Whether a pooling job's summary completes its concept: always, but where the concept is pooled in passes
        over its layers; its last pass writes the manifest here (no pass names every layer) and sums the seconds."""
        concept = summary["concept"]
        if concept not in self.passes_left:
            return True
        self.passes_left[concept] -= 1
        self.pass_seconds[concept] = self.pass_seconds.get(concept, 0.0) + summary["seconds"]
        if self.passes_left[concept] > 0:
            return False
        plan = self.plans[concept]
        if not self.drop:
            write_pooled_manifest(self.inputs.store, plan.pooled_key, self.run.layers, self.cfg.store_dtype)
        return True

    def pool(self, group: PoolGroup) -> ActorJob[ConceptJob]:
        cfg, run, store_url = self.cfg, self.run, self.inputs.store_url
        tasks = [PoolTask(plan.concept, plan.passages, plan.pooled_key,
                          {**self.metadata, "concept": plan.concept, "corpus": plan.corpus_hash}, tuple(layers),
                          plan.dump_key, manifest=not self.drop and plan.concept not in self.passes_left)
                 for plan, layers in group]
        key = ConceptJob("pool", tasks[0].concept, group=tuple(t.concept for t in tasks) if len(tasks) > 1 else ())
        return ActorJob(key, lambda worker: worker.pool_concepts.remote(
            tasks, self.strategy_ids, store_url=store_url, batch_size=cfg.batch_size,
            max_length=run.variant.max_length(cfg.max_length), max_batch_tokens=cfg.max_batch_tokens,
            store_dtype=cfg.store_dtype, all_layers=run.layers, overlap=cfg.overlap,
            **({"site": run.variant.site} if run.variant.site != RESIDUAL else {})))

    def stored(self, key: str) -> bool:
        """Stored and whole; a corrupt artifact is quarantined, reported and recomputed instead of stopping."""
        store = self.inputs.store
        before = len(store.quarantined)
        whole = store.intact(key)
        for bad_key, reason in store.quarantined[before:]:
            self.emit(ArtifactQuarantined(bad_key, reason))
        return whole

    def probe(self, plan: ConceptPlan, layer: int) -> TaskJob[ConceptJob]:
        cfg, key = self.cfg, ConceptJob("probe", plan.concept, layer)

        def start() -> ray.ObjectRef:
            self.submitted[key] = time.perf_counter()  # a retry starts the clock again
            return self.probe_task.options(**self.probe_resources, runtime_env=self.runtime_env).remote(
                self.inputs.store_url, plan.pooled_key, plan.d1_key, plan.concept, layer, cfg.probing,
                types={p.id: p.domain for p in plan.passages}, tiers={p.id: p.tier for p in plan.passages},
                corpus_order=tuple(p.id for p in plan.passages))  # the corpus files' order (load_corpus)

        return TaskJob(key, start)

    def gather(self, plan: ConceptPlan) -> None:
        """A concept's D1 from its layers'; with --drop-pooled its vectors then leave the store, and the pooling
        their room lets start is handed to the queue's next follow-up (after)."""
        gather_layer_d1(self.inputs.store, plan.d1_key, self.run.layers)
        self.computed["d1"] += 1
        self.emit(ConceptProbed(plan.concept, skipped=False))
        if self.drop:
            self.drop_vectors(plan)

    def counted_store(self) -> LocalStore | None:
        """The folder store whose disk the room gate counts (None: no bound, nothing to measure)."""
        store = self.inputs.store
        return store if self.room.room is not None and isinstance(store, LocalStore) else None

    def measure_room(self, concept: str) -> None:
        """With a bounded room, what a pooled concept's files take on disk against its count (room_gate.py)."""
        store = self.counted_store()
        if store is not None:
            stored = store.stored_bytes(pooled_keys(self.plans[concept].pooled_key, self.run.layers))
            self.release(self.room.measured(concept, stored))

    def release(self, jobs: list[Job[ConceptJob]]) -> None:
        """Pooling jobs the room let start, for the queue's next follow-up (after)."""
        self.pools_running += len(jobs)
        self.released += jobs

    def drop_vectors(self, plan: ConceptPlan) -> None:
        if drop_pooled(self.inputs.store, plan.pooled_key, self.run.layers):
            self.computed["pooled_dropped"] = self.computed.get("pooled_dropped", 0) + 1
        store = self.counted_store()
        written = store.stored_bytes(d1_keys(plan.d1_key, self.run.layers)) if store is not None else 0
        self.release(self.room.dropped(plan.concept, written))

    def probe_unless_stored(self, plan: ConceptPlan) -> list[Job[ConceptJob]]:
        if self.stored(plan.d1_key):
            self.computed["d1_skipped"] += 1
            self.emit(ConceptProbed(plan.concept, skipped=True))
            if self.drop:  # a run stopped between the gathering and the drop
                self.drop_vectors(plan)
            return []
        todo = [layer for layer in self.run.layers if not self.stored(layer_shard_key(plan.d1_key, layer))]
        if not todo:  # every layer was probed before the driver stopped: only the gathering is left
            self.gather(plan)
            return []
        self.unprobed[plan.concept] = set(todo)
        return [self.probe(plan, layer) for layer in todo]

    def parse(self, plan: ConceptPlan) -> TaskJob[ConceptJob]:
        return TaskJob(ConceptJob("parse", plan.concept), lambda: self.parse_task.options(
            num_cpus=1, runtime_env=self.runtime_env).remote(
            self.inputs.store_url, plan.concept, plan.passages, plan.corpus_hash))


def d1_keys(d1_key: str, layers: Sequence[int]) -> list[str]:
    """What a concept's probes store: its D1 records and per-passage scores, and each layer's."""
    shards = [layer_shard_key(d1_key, layer) for layer in layers]
    return [key for shard in [d1_key, *shards] for key in (shard, passage_scores_key(shard))]


def parse_ahead(cfg: RunConfig, specs: Sequence[StrategySpec], on_gpu: bool) -> bool:
    """Parse concepts in CPU tasks ahead of their pooling jobs where strategies need parses and the text work
    overlaps the forward (on a GPU unless --no-overlap; on CPU only with --overlap, which then shares the cores)."""
    return "parse" in strategy_needs(specs) and beside_the_forward(cfg, on_gpu)


