"""ExtractorWorker: owns one loaded model (one GPU on a cluster), turns a concept into PooledTable shards.

A plain class so tests can drive it without Ray; the driver wraps it with `ray.remote` and `num_gpus`.
Pooling happens in this process, so token activations never cross the object store or touch disk.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from poolbench.corpus.passage import Passage
from poolbench.errors import PoolBenchError
from poolbench.extractor.activation_dump import activation_dump_table
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.batching import free_memory_bytes
from poolbench.extractor.loading import load_model
from poolbench.extractor.model_config import attention_heads
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.concept_pooling import ConceptPassages, pool_concept_group, strategy_needs
from poolbench.pooler.gradient_sums import gradient_table_key
from poolbench.pooler.iti import encode_head_table, head_table_key
from poolbench.pooler.learned import learned_table_key
from poolbench.pooler.parse_task import concept_parses
from poolbench.pooler.parses import ParseIndex
from poolbench.pooler.pooled_table import StoreDtype, check_float16, encode_vectors, write_pooled_manifest
from poolbench.pooler.registry import (
    load_entry_point_strategies,
    load_strategy_module,
    resolve_strategies,
)
from poolbench.pooler.spec import StrategySpec
from poolbench.pooler.stored_size import vector_bytes_per_passage_layer, write_copy_bytes_per_passage_layer
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key
from poolbench.store.url import open_store

logger = logging.getLogger(__name__)


class ExtractorWorker:
    def __init__(self, model: str, *, dtype: str = "auto", device: str = "auto",
                 model_args: dict | None = None, torch_threads: int | None = None,
                 strategy_modules: Sequence[str] = ()) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        load_entry_point_strategies()  # installed plugins register in every worker process too
        for path in strategy_modules:
            load_strategy_module(path)
        self.loaded = load_model(model, dtype=dtype, device=device, model_args=model_args)
        self.models_loaded = [model]
        self._progress: dict | None = None

    def switch_model(self, model: str, *, dtype: str = "auto", device: str = "auto",
                     model_args: dict | None = None) -> dict:
        """Free the model held now, then load `model` in this same process: a run over several models keeps its
        workers (imports, plugins, threads) and never holds two models at once; the new model's info()."""
        del self.loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.loaded = load_model(model, dtype=dtype, device=device, model_args=model_args)
        self.models_loaded.append(model)
        return self.info()

    def loads(self) -> list[str]:
        """Every model this worker has loaded, in order: one entry per model of the run, never one per concept."""
        return list(self.models_loaded)

    def progress(self) -> dict | None:
        """Where the pooling job is now (its concepts, batches, passages, tokens, seconds), None when idle; the
        driver polls it from a second actor thread, so it only reads what on_batch last wrote."""
        progress = self._progress
        return None if progress is None else {**progress, "seconds": time.perf_counter() - progress["started"]}

    def pid(self) -> int:
        """The worker's process id, so fault-tolerance tests (and operators) can find and kill it."""
        return os.getpid()

    def info(self) -> dict:
        """What the driver needs to plan artifact keys: identity and shape of the model."""
        m = self.loaded
        return {"model_id": m.model_id, "weights_hash": m.weights_hash, "n_layers": m.n_layers,
                "hidden_size": m.hidden_size, "kind": m.kind, "dtype": str(m.dtype), "device": str(m.device)}

    def host_room(self) -> dict:
        """The host this worker runs on (its boot id: Ray nodes in containers on one machine share its memory) and
        the memory available there, so the driver fits pooling jobs to it before the first forward (host_room)."""
        boot_id = Path("/proc/sys/kernel/random/boot_id")
        return {"host": boot_id.read_text().strip() if boot_id.exists() else socket.gethostname(),
                "available": free_memory_bytes("cpu")}

    def stored_bytes_per_passage_layer(self, strategies: Sequence[str], store_dtype: StoreDtype) -> int:
        """The vector bytes one passage's pooling adds to one layer's stored objects with this model (a lower
        bound: stored_size), so the driver can check the store's room before the first forward."""
        heads, head_dim = attention_heads(self.loaded.model)
        return vector_bytes_per_passage_layer(resolve_strategies(list(strategies)), self.loaded.hidden_size, heads,
                                              head_dim, store_dtype)

    def host_bytes_per_passage_layer(self, strategies: Sequence[str], store_dtype: StoreDtype,
                                     buffered: bool) -> tuple[int, int]:
        """The bytes one passage's pooling holds at one layer on this host until written (float32), and what the
        writes add beside them at most (stored_size.write_copy_bytes_per_passage_layer): the driver fits the jobs
        to the host's memory from them (driver/host_room.py)."""
        heads, head_dim = attention_heads(self.loaded.model)
        specs, d = resolve_strategies(list(strategies)), self.loaded.hidden_size
        return (vector_bytes_per_passage_layer(specs, d, heads, head_dim, "float32"),
                write_copy_bytes_per_passage_layer(specs, d, heads, head_dim, store_dtype, buffered))

    def pool_concept(self, concept: str, passages: Sequence[Passage], layers: Sequence[int],
                     strategies: Sequence[str], *, store_url: str, key: str, metadata: dict[str, str],
                     batch_size: int, max_length: int, dump_key: str | None = None,
                     max_batch_tokens: int | None = None, store_dtype: StoreDtype = "float32",
                     all_layers: Sequence[int] | None = None, overlap: bool | None = None,
                     site: str = "residual") -> dict:
        """Pool `layers` and write one PooledTable shard per layer (its ITIHeadTable shard first), then the
        manifest under `key` once every layer of `all_layers` (default: `layers`) is stored; returns a summary.

        A resumed run passes only the layers whose shards are missing; the others are left as they are."""
        task = PoolTask(concept, passages, key, metadata, tuple(layers), dump_key)
        [summary] = self.pool_concepts([task], strategies, store_url=store_url, batch_size=batch_size,
                                       max_length=max_length, max_batch_tokens=max_batch_tokens,
                                       store_dtype=store_dtype, all_layers=all_layers, overlap=overlap, site=site)
        return summary

    def pool_concepts(self, tasks: Sequence[PoolTask], strategies: Sequence[str], *, store_url: str,
                      batch_size: int, max_length: int, max_batch_tokens: int | None = None,
                      store_dtype: StoreDtype = "float32", all_layers: Sequence[int] | None = None,
                      overlap: bool | None = None, site: str = "residual") -> list[dict]:
        """Pool several concepts in shared forwards and write each one's missing shards and its manifest exactly
        as a concept pooled alone; one summary per task, in order.

        Shards already stored are left as they are and their layers not pooled again, so a job retried after its
        worker died mid-way writes only what the first attempt did not (a dump pools every layer it is given).
        `site` is the activation site every task's shards hold (extractor.site_hooks; its key says so).

        The forwards (`_compute_group`) and the writes are two steps: an actor runs the first on its compute
        thread and the second on the calling thread (extractor_fleet), so with a second job already sent to it
        (a GPU run's queue sends two) the next job's forwards run while this one's shards are written."""
        store = open_store(store_url)
        work, pooled, seconds = self._compute_group(tasks, strategies, store=store, batch_size=batch_size,
                                                    max_length=max_length, max_batch_tokens=max_batch_tokens,
                                                    overlap=overlap, site=site)
        layers = list(all_layers) if all_layers is not None else None
        group = [t.concept for t, missing in work if missing]
        return [{**self._store(store, task, missing, pooled.get(task.key), store_dtype, layers or list(task.layers)),
                 "group_seconds": seconds, "group": group} for task, missing in work]

    def _compute_group(self, tasks: Sequence[PoolTask], strategies: Sequence[str], *, store: ArtifactStore,
                       batch_size: int, max_length: int, max_batch_tokens: int | None, overlap: bool | None,
                       site: str) -> tuple[list[tuple[PoolTask, list[int]]], dict[str, _Pooled], float]:
        """Each task's missing layers, the group's pooled tables (nothing written yet) and the seconds it took."""
        specs = resolve_strategies(list(strategies))
        start = time.perf_counter()
        work: list[tuple[PoolTask, list[int]]] = []
        for task in tasks:
            redo = task.dump_key is not None and not store.exists(task.dump_key)
            gradients = "gradient" in strategy_needs(specs)  # a shard stored before its gradient sums is redone
            missing = list(task.layers) if redo else \
                [layer for layer in task.layers if not store.exists(layer_shard_key(task.key, layer))
                 or (gradients and not store.exists(gradient_table_key(layer_shard_key(task.key, layer))))]
            work.append((task, missing))
        pooling = [(task, missing) for task, missing in work if missing]
        dumps = [task for task, _ in pooling if task.dump_key is not None]
        if dumps and len(pooling) > 1:
            raise PoolBenchError(f"concept {dumps[0].concept}: an activation dump is pooled alone, not in a group")
        pooled = self._pool(pooling, specs, store, batch_size=batch_size, max_length=max_length,
                            max_batch_tokens=max_batch_tokens, overlap=overlap, site=site) if pooling else {}
        return work, pooled, time.perf_counter() - start

    @staticmethod
    def _store(store: ArtifactStore, task: PoolTask, missing: list[int], done: _Pooled | None,
               store_dtype: StoreDtype, all_layers: list[int], writers: int | None = None) -> dict:
        """Write one concept's missing shards (each ITIHeadTable shard before its PooledTable: a stored shard means
        its heads are stored too), then its manifest once every layer is stored; the concept's summary.

        Layers are encoded and written on `writers` threads (shard_writers()): at the full corpus a concept's shards
        are ~10 GB at d 4,096 (S3's per-head vectors are 32 of a pooled vector), and one thread serialising,
        hashing and fsyncing them in turn held an H100's extractor ~13 s a concept of 800 passages. Each object is
        atomic on its own and the manifest comes last, so a failure anywhere leaves the concept unpooled. `done`
        is consumed: each layer's tables leave it as they are written (the host's memory falls as the job writes)."""
        written: dict[int, tuple[int, int]] = {}  # a written layer's rows and fallback rows
        if done is not None:
            where = f"concept {task.concept} "
            for layer in missing:  # a value float16 cannot hold stops the concept before any shard is written
                check_float16(done.tables[layer], store_dtype, where)
                if done.heads is not None:
                    check_float16(done.heads[layer], store_dtype, where, "pooled")
            if done.dump is not None:
                assert task.dump_key is not None
                store.put_table(task.dump_key, done.dump)
            with ThreadPoolExecutor(shard_writers(len(missing), writers), "poolbench-shards") as pool:
                rows = pool.map(lambda layer: _write_layer(store, task.key, layer, done, store_dtype, where), missing)
                written = dict(zip(missing, rows, strict=True))
        if task.manifest and (written or not store.exists(task.key)):
            write_pooled_manifest(store, task.key, all_layers, store_dtype)
        skipped = done.skipped if done is not None else ()
        for passage_id, n_tokens in skipped:
            logger.warning("concept %s: passage %s (%d tokens) does not fit the device alone; skipped",
                           task.concept, passage_id, n_tokens)
        return {"concept": task.concept, "key": task.key, "layers": list(written),
                "rows": sum(rows for rows, _ in written.values()), "tokens": done.tokens if done is not None else 0,
                "seconds": done.seconds if done is not None else 0.0,
                "skipped_passages": [{"id": pid, "tokens": n} for pid, n in skipped],
                "fallback_rows": sum(fallback for _, fallback in written.values())}

    def _pool(self, work: Sequence[tuple[PoolTask, list[int]]], specs: list[StrategySpec], store: ArtifactStore,
              *, batch_size: int, max_length: int, max_batch_tokens: int | None,
              overlap: bool | None, site: str = "residual") -> dict[str, _Pooled]:
        """One pool_concept_group over the tasks at the union of their missing layers, with progress and (for a
        lone task with a dump key) the activation dump; keyed by each task's artifact key."""
        start = time.perf_counter()
        layers = sorted({layer for _, missing in work for layer in missing})
        members = [ConceptPassages(task.concept, task.passages, task.metadata,
                                   self._parses(store, task, specs)) for task, _ in work]
        starts = np.cumsum([0] + [len(task.passages) for task, _ in work])
        tokens = np.zeros(len(work), dtype=np.int64)
        dumped: list[pa.Table] = []
        dumping = any(task.dump_key is not None for task, _ in work)
        self._progress = {"concept": work[0][0].concept, "concepts": [task.concept for task, _ in work],
                          "batches": 0, "passages_done": 0, "passages_total": int(starts[-1]), "tokens_done": 0,
                          "started": start}

        def on_batch(chunk: PaddedBatch, activations: ActivationBatch | None) -> None:
            owners = np.searchsorted(starts, np.asarray(chunk.indices), side="right") - 1
            np.add.at(tokens, owners, chunk.attention_mask.sum(axis=1))
            if self._progress is not None:
                self._progress = {**self._progress, "batches": self._progress["batches"] + 1,
                                  "tokens_done": int(tokens.sum()),
                                  "passages_done": self._progress["passages_done"] + len(chunk.passage_ids)}
            if activations is not None and dumping:
                dumped.append(activation_dump_table(activations))

        try:
            results = pool_concept_group(self.loaded, members, layers, specs, batch_size=batch_size,
                                         max_length=max_length, on_batch=on_batch, max_batch_tokens=max_batch_tokens,
                                         keep_activations=dumping, overlap=overlap, site=site)
        finally:
            self._progress = None
        seconds = time.perf_counter() - start
        share = tokens / max(int(tokens.sum()), 1)
        return {task.key: _Pooled(pooled.layers, pooled.layer_heads, pooled.skipped, int(tokens[i]),
                                  seconds * float(share[i]), pa.concat_tables(dumped) if task.dump_key else None,
                                  pooled.layer_gradients, pooled.layer_learned)
                for i, ((task, _), pooled) in enumerate(zip(work, results, strict=True))}

    @staticmethod
    def _parses(store: ArtifactStore, task: PoolTask, specs: Sequence[StrategySpec]) -> ParseIndex | None:
        """The concept's parses when a strategy needs them: parsed once per corpus, reused by every run and metric."""
        if "parse" not in strategy_needs(specs):
            return None
        return ParseIndex.from_table(concept_parses(store, task.passages,
                                                    task.metadata.get("corpus", task.concept))[0])


SHARD_WRITERS = 8  # threads writing a concept's layer shards at most (serialising, hashing, fsync: GIL released)


def shard_writers(layers: int, requested: int | None = None) -> int:
    """Threads for a concept's shards: `requested`, else one a layer up to SHARD_WRITERS and the host's cores."""
    wanted = requested if requested is not None else min(SHARD_WRITERS, os.cpu_count() or 1)
    return max(1, min(wanted, layers))


def _write_layer(store: ArtifactStore, key: str, layer: int, done: _Pooled, store_dtype: StoreDtype,
                 where: str) -> tuple[int, int]:
    """One layer's objects, its PooledTable shard last (a stored shard means its companions are stored too); its
    rows and fallback rows. Each table is encoded here and the job's float32 copy of it let go as soon as it is, so
    while a job writes it holds its vectors and what its writers hold at once (host_room.VectorBytes), not every
    layer encoded beside them."""
    shard_key = layer_shard_key(key, layer)
    if done.heads is not None:
        store.put_table(head_table_key(shard_key), encode_head_table(done.heads.pop(layer), store_dtype, where))
    if done.gradients is not None and layer in done.gradients:
        store.put_table(gradient_table_key(shard_key), done.gradients[layer])
    if done.learned is not None:
        store.put_table(learned_table_key(shard_key), done.learned[layer])
    table = encode_vectors(done.tables.pop(layer), store_dtype, where).combine_chunks()
    store.put_table(shard_key, table)
    return table.num_rows, int(pc.sum(table.column("fallback")).as_py() or 0)


@dataclass(frozen=True)
class PoolTask:
    """One concept of a pooling job: its passages, where its shards and manifest go (`key`), the metadata its
    tables carry, the layers to store, and an activation dump's key when one is asked for."""

    concept: str
    passages: Sequence[Passage]
    key: str
    metadata: dict[str, str]
    layers: tuple[int, ...]
    dump_key: str | None = None
    manifest: bool = True  # False for a pass over some of the concept's layers: the driver writes it after the last


@dataclass(frozen=True)
class _Pooled:
    """One concept's share of a group job: its tables, its tokens and its token share of the job's seconds."""

    tables: dict[int, pa.Table]
    heads: dict[int, pa.Table] | None
    skipped: tuple[tuple[str, int], ...]
    tokens: int
    seconds: float
    dump: pa.Table | None
    gradients: dict[int, pa.Table] | None = None
    learned: dict[int, pa.Table] | None = None  # LearnedFoldTable per layer (learned aggregators)
