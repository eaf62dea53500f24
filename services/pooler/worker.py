"""ExtractorWorker: owns one loaded model (one GPU on a cluster), turns a concept into PooledTable shards.

A plain class so tests can drive it without Ray; the driver wraps it with `ray.remote` and `num_gpus`.
Pooling happens in this process, so token activations never cross the object store or touch disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import torch

from poolbench.corpus.passage import Passage
from poolbench.extractor.activation_dump import activation_dump_table
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.extract import PaddedBatch
from poolbench.extractor.loading import load_model
from poolbench.pooler.concept_pooling import pool_concept_tables, strategy_needs
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.parses import ParseIndex, cached_parse_table, ids_digest
from poolbench.pooler.pooled_table import StoreDtype, encode_vectors, write_pooled_manifest
from poolbench.pooler.registry import (
    load_entry_point_strategies,
    load_strategy_module,
    resolve_strategies,
)
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
        self._progress: dict | None = None

    def progress(self) -> dict | None:
        """Where pool_concept is now (concept, batches, passages, tokens, seconds), None when idle; the driver
        polls it from a second actor thread, so it only reads what on_batch last wrote."""
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

    def pool_concept(self, concept: str, passages: Sequence[Passage], layers: Sequence[int],
                     strategies: Sequence[str], *, store_url: str, key: str, metadata: dict[str, str],
                     batch_size: int, max_length: int, dump_key: str | None = None,
                     max_batch_tokens: int | None = None, store_dtype: StoreDtype = "float32",
                     all_layers: Sequence[int] | None = None) -> dict:
        """Pool `layers` and write one PooledTable shard per layer (its ITIHeadTable shard first), then the
        manifest under `key` once every layer of `all_layers` (default: `layers`) is stored; returns a summary.

        A resumed run passes only the layers whose shards are missing; the others are left as they are."""
        store = open_store(store_url)
        specs = resolve_strategies(list(strategies))
        dumped: list[pa.Table] = []
        tokens = 0

        start = time.perf_counter()
        self._progress = {"concept": concept, "batches": 0, "passages_done": 0, "passages_total": len(passages),
                          "tokens_done": 0, "started": start}

        def on_batch(batch: PaddedBatch | ActivationBatch) -> None:
            nonlocal tokens
            tokens += int(batch.attention_mask.sum())
            if self._progress is not None:
                self._progress = {**self._progress, "batches": self._progress["batches"] + 1, "tokens_done": tokens,
                                  "passages_done": self._progress["passages_done"] + len(batch.passage_ids)}
            if isinstance(batch, ActivationBatch) and dump_key is not None:
                dumped.append(activation_dump_table(batch))

        parses = None
        if "parse" in strategy_needs(specs):  # parsed once per corpus, reused by every run and metric
            parsed, _ = cached_parse_table(store, [p.text for p in passages], [p.id for p in passages],
                                           corpus_hash=metadata.get("corpus", concept),
                                           passages_digest=ids_digest([p.id for p in passages]))
            parses = ParseIndex.from_table(parsed)
        pooled = pool_concept_tables(self.loaded, passages, layers, specs, batch_size=batch_size,
                                     max_length=max_length, metadata=metadata, on_batch=on_batch, parses=parses,
                                     max_batch_tokens=max_batch_tokens, keep_activations=dump_key is not None)
        for passage_id, n_tokens in pooled.skipped:
            logger.warning("concept %s: passage %s (%d tokens) does not fit the device alone; skipped", concept,
                           passage_id, n_tokens)
        seconds = time.perf_counter() - start
        self._progress = None
        # Every shard is encoded before any is written: a value float16 cannot hold stops the concept whole.
        shards = {layer: encode_vectors(table, store_dtype, f"concept {concept} ").combine_chunks()
                  for layer, table in pooled.layers.items()}
        if dump_key is not None:
            store.put_table(dump_key, pa.concat_tables(dumped))
        for layer, table in shards.items():
            shard_key = layer_shard_key(key, layer)
            if pooled.layer_heads is not None:  # before its PooledTable: a stored shard means its heads are
                store.put_table(head_table_key(shard_key), pooled.layer_heads[layer])
            store.put_table(shard_key, table)
        write_pooled_manifest(store, key, list(all_layers if all_layers is not None else layers), store_dtype)
        return {"concept": concept, "key": key, "layers": list(shards),
                "rows": sum(t.num_rows for t in shards.values()), "tokens": tokens, "seconds": seconds,
                "skipped_passages": [{"id": pid, "tokens": n} for pid, n in pooled.skipped],
                "fallback_rows": sum(int(pc.sum(t.column("fallback")).as_py() or 0) for t in shards.values())}
