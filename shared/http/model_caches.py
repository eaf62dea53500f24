"""What a replica loads once and keeps: language models, scorers, the run's steering vectors and steering
engines, each use of a model or scorer holding its lock (a model carries shared state besides hooks)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from poolbench.errors import PoolBenchError
from poolbench.http.schemas import (
    StoredVector,
)
from poolbench.http.service_errors import NotServed, RequestError, ServiceConfigError
from poolbench.http.settings import ServiceSettings
from poolbench.http.text_pooling import strategy_spec


class ModelCache:
    """Loaded models by id, least recently used dropped first, each with the lock every use of it holds."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._models: OrderedDict[str, tuple[object, threading.Lock]] = OrderedDict()
        self._lock = threading.Lock()

    @contextmanager
    def use(self, model: str) -> Iterator:
        """The loaded model, held alone by this request for the block (loaded on first use, once)."""
        from poolbench.extractor.loading import load_model

        if model not in self.settings.models:
            raise NotServed(f"model '{model}' is not served here "
                            f"(served: {', '.join(self.settings.models) or 'none'})")
        with self._lock:
            if model not in self._models:
                loaded = load_model(model, dtype=self.settings.dtype, device=self.settings.device)
                self._models[model] = (loaded, threading.Lock())
                while len(self._models) > self.settings.max_loaded_models:
                    self._models.popitem(last=False)
            self._models.move_to_end(model)
            loaded, lock = self._models[model]
        with lock:
            yield loaded


class ScorerCache:
    """Classifier B per concept, from a folder or a store key, loaded on first use; each with its own lock."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._scorers: dict[str, tuple[object, threading.Lock]] = {}
        self._lock = threading.Lock()

    def _load(self, concept: str):
        from poolbench.scorer.artifacts import load_stored_scorer
        from poolbench.scorer.scorer_model import ScorerModel
        from poolbench.store.url import open_store

        try:
            if concept in self.settings.scorers:
                return ScorerModel.load(self.settings.scorers[concept])
            return load_stored_scorer(open_store(self.settings.scorer_store), self.settings.scorer_keys[concept],
                                      concept)
        except PoolBenchError as exc:
            raise ServiceConfigError(str(exc).splitlines()[0]) from exc

    @contextmanager
    def use(self, concept: str) -> Iterator:
        if concept not in self.settings.scorer_concepts:
            raise NotServed(f"no scorer for concept '{concept}' "
                            f"(configured: {', '.join(self.settings.scorer_concepts) or 'none'})")
        with self._lock:
            if concept not in self._scorers:
                self._scorers[concept] = (self._load(concept), threading.Lock())
            scorer, lock = self._scorers[concept]
        with lock:
            yield scorer


class VectorCache:
    """The run's steering vectors (alpha = 1 deltas) by (concept, strategy, layer, unit), built on first use."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._vectors: dict[tuple[str, str, int, str], np.ndarray] = {}
        self._lock = threading.Lock()

    def get(self, req: StoredVector, layer: int) -> np.ndarray:
        from poolbench.pooler.pooled_table import PooledTableView, read_pooled_table, stored_layers
        from poolbench.steerer.run import steering_vector
        from poolbench.store.url import open_store

        strategy = strategy_spec(req.strategy).id
        key = (req.concept, strategy, layer, req.unit)
        if req.concept not in self.settings.pooled_keys:
            raise NotServed(f"no stored vectors for concept '{req.concept}' "
                            f"(run concepts: {', '.join(sorted(self.settings.pooled_keys)) or 'none'})")
        norm = self.settings.residual_norms.get(f"{req.concept}/{layer}")
        if req.unit == "residual" and norm is None:
            raise RequestError(f"stored: the run measured no residual norm for '{req.concept}' at layer {layer} "
                               "(no D2 cell there); use unit 'raw'")
        with self._lock:
            if key not in self._vectors:
                try:
                    store = open_store(self.settings.vector_store)
                    pooled_key = self.settings.pooled_keys[req.concept]
                    if layer not in stored_layers(store, pooled_key):
                        raise RequestError(f"concept '{req.concept}': no pooled cell (layer {layer}, strategy "
                                           f"'{strategy}') in the run's store")
                    table = read_pooled_table(store, pooled_key, [layer])
                except RequestError:
                    raise
                except PoolBenchError as exc:
                    raise ServiceConfigError(str(exc).splitlines()[0]) from exc
                vector = steering_vector(PooledTableView(table), req.concept, strategy, layer)
                if vector.direction is None:
                    raise RequestError(f"stored: {req.concept}/{strategy}/L{layer} has no steering vector: "
                                       f"{vector.null_reason}")
                scale = norm if req.unit == "residual" else vector.raw_norm
                self._vectors[key] = (float(scale) * vector.direction.astype(np.float64)).astype(np.float32)
            return self._vectors[key]


class SteeringEngines:
    """The /generate backend per served model: transformers on the loaded model, or one vLLM engine per model
    (started on first use, kept; each request's vector is its own slot of the engine call)."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._engines: dict[str, object] = {}
        self._lock = threading.Lock()
        if settings.steering_backend == "vllm":
            from poolbench.steerer.vllm_backend import require_vllm

            require_vllm()

    def backend(self, model: str, loaded):
        if self.settings.steering_backend == "transformers":
            from poolbench.steerer.transformers_backend import TransformersBackend

            return TransformersBackend(loaded)
        from poolbench.steerer.vllm_backend import VLLMBackend

        with self._lock:
            if model not in self._engines or self._engines[model].dead:  # a dead engine: a new one
                self._engines[model] = VLLMBackend(str(loaded.path), dtype=self.settings.dtype)
            return self._engines[model]
