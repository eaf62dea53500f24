"""PoolBench over HTTP: the one Ray Serve application, a FastAPI ingress with /pool, /probe, /score, /generate.

Handlers are thin: they validate (pydantic, size limits, finite numbers, a body limit counted while streaming)
and call the functions the batch pipeline uses (pool_concept, probe_pooled_table, ScorerModel,
TransformersBackend). Requests run concurrently in a replica's threads; each use of a loaded model (LM or
scorer) holds that model's lock, because a model carries shared state besides hooks (the fast tokenizer's
padding/truncation settings, the attention implementation S1 swaps in) and one CPU forward already uses every
core. Hooks are request-local as well (poolbench.extractor.hook_points); /probe's statistics run outside the lock.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from poolbench.compute_thread import ComputeThread
from poolbench.defaults import default_store_url
from poolbench.errors import PoolBenchError

from .admission import Admission
from .body_limit import BodyLimit

if TYPE_CHECKING:  # loaded lazily: importing the app loads no steering code
    from poolbench.steerer.generation_rows import GenerationRow

APP_NAME = "poolbench"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
TOKEN_ENV = "POOLBENCH_TOKEN"
OPEN_PATHS = ("/healthz",)  # answered without the bearer token: liveness checks carry no secret


class RequestError(PoolBenchError):
    """A well-formed request the service cannot serve as asked (too big, wrong layer): HTTP 422."""


class NotServed(PoolBenchError):
    """A model or scorer this service was not configured with: HTTP 404."""


class ServiceConfigError(PoolBenchError):
    """The service's own configuration is unusable (no such run, a scorer artefact missing): HTTP 503."""


class ServiceSettings(BaseModel):
    """What the service may load and how big a request may be; fixed when the application is built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[str, ...] = ("embedded",)  # ids/paths a request may name: nothing else is ever loaded
    scorers: dict[str, str] = Field(default_factory=dict)  # concept -> scorer folder (classifier B)
    scorer_store: str | None = None  # artifact store (folder or s3://) holding `scorer_keys`
    scorer_keys: dict[str, str] = Field(default_factory=dict)  # concept -> stored scorer key, as a run records
    vector_store: str | None = None  # artifact store holding `pooled_keys` (a run's store)
    pooled_keys: dict[str, str] = Field(default_factory=dict)  # concept -> the run's pooled table: stored vectors
    residual_norms: dict[str, float] = Field(default_factory=dict)  # "concept/layer" -> the run's alpha unit
    leaderboard: dict = Field(default_factory=dict)  # a run's leaderboard.json, served at /leaderboard
    max_texts: int = Field(256, ge=1)
    max_chars: int = Field(4000, ge=1)
    max_body_bytes: int = Field(2_000_000, ge=1024)
    max_new_tokens: int = Field(64, ge=1)
    max_bootstrap: int = Field(2000, ge=0)
    max_loaded_models: int = Field(2, ge=1)
    # Requests admitted into a replica at once. They wait for its one compute thread, where the waiting requests
    # of an endpoint run as one batch: the more are admitted, the bigger the batches (and the longer the wait).
    max_working: int = Field(64, ge=1)
    max_queued: int = Field(0, ge=0)  # requests waiting at the door (not batched); beyond both: 503 + Retry-After
    batch_size: int = Field(16, ge=1)  # requests one batch may merge
    max_length: int = Field(256, ge=8)
    device: str = "auto"
    dtype: str = "auto"
    steering_backend: Literal["transformers", "vllm"] = "transformers"  # vllm: /generate on a vLLM engine (GPU)
    token: str | None = Field(None, min_length=16, repr=False, exclude=True)  # bearer token; None: no auth

    @model_validator(mode="after")
    def _one_source_per_concept(self) -> ServiceSettings:
        if self.scorer_keys and not self.scorer_store:
            raise ValueError("scorer_keys need scorer_store, the store that holds them")
        if self.pooled_keys and not self.vector_store:
            raise ValueError("pooled_keys need vector_store, the store that holds them")
        both = sorted(set(self.scorers) & set(self.scorer_keys))
        if both:
            raise ValueError(f"concepts {both} have both a scorer folder and a stored scorer key")
        return self

    @property
    def scorer_concepts(self) -> list[str]:
        return sorted({*self.scorers, *self.scorer_keys})


def _run_document(run: str | Path) -> tuple[Path, dict]:
    """A run folder's results.json, or one line saying why it cannot be read."""
    path = Path(run) / "results.json"
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ServiceConfigError(f"{path}: no such file ('{run}' is not a finished run folder)") from exc
    except json.JSONDecodeError as exc:
        raise ServiceConfigError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from exc


def scorers_of_run(run: str | Path) -> dict:
    """{"scorer_store", "scorer_keys"} from a run folder's results.json: /score then answers every concept it has."""
    path, doc = _run_document(run)
    keys = {s["concept"]: s["key"] for s in doc.get("scorers") or [] if s.get("key")}
    if not keys:
        raise ServiceConfigError(f"{path}: the run recorded no scorers (it ran with --no-steering?)")
    store = (doc.get("config") or {}).get("store") or default_store_url()
    return {"scorer_store": store, "scorer_keys": keys}


def vectors_of_run(run: str | Path) -> dict:
    """{"vector_store", "pooled_keys", "residual_norms"} from a run's results.json: /generate can then steer with
    any (concept, strategy, layer) DiffMean vector of the run, alpha in the unit its D2 stage used."""
    _, doc = _run_document(run)
    keys = {c: a["pooled"] for c, a in (doc.get("artifacts") or {}).items() if a.get("pooled")}
    norms = {f"{r['concept']}/{r['layer']}": float(r["residual_norm"]) for r in doc.get("d2") or []
             if r.get("residual_norm") is not None}
    store = (doc.get("config") or {}).get("store") or default_store_url()
    return {"vector_store": store, "pooled_keys": keys, "residual_norms": norms} if keys else {}


def check_scorers(settings: ServiceSettings) -> None:
    """Fail at start, in one line, when a configured scorer is not there, rather than at the first /score."""
    missing = [f"{c} ({folder})" for c, folder in sorted(settings.scorers.items()) if not Path(folder).is_dir()]
    if settings.scorer_keys:
        from poolbench.store.url import open_store

        store = open_store(settings.scorer_store)
        missing += [f"{c} ({key})" for c, key in sorted(settings.scorer_keys.items()) if not store.exists(key)]
    if missing:
        raise ServiceConfigError(f"scorers not found: {', '.join(missing)}")


Text = Annotated[str, StringConstraints(min_length=1)]
_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity are valid JSON to Python, not to us


class PoolRequest(BaseModel):
    model_config = _REQUEST
    model: str = Field("embedded", description="a model this service serves (see /healthz)")
    layer: int = Field(ge=0, description="hook point layers.{layer}.out")
    strategy: str = Field("A1_mean", description="strategy id or short code; unsupervised, no corpus statistics")
    texts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")


class LabelledText(BaseModel):
    model_config = _REQUEST
    text: Text = Field(description="at most max_chars characters")
    label: int = Field(ge=0, le=1)
    split: str = Field(pattern="^(train|test)$")
    group: str | None = Field(None, description="matched_pair_id: a pair stays in one fold, resamples together")


class ProbeRequest(BaseModel):
    model_config = _REQUEST
    model: str = "embedded"
    layer: int = Field(ge=0)
    strategy: str = "A1_mean"
    items: list[LabelledText] = Field(min_length=4, description="at most max_texts; both labels in both splits")
    n_folds: int = Field(5, ge=2, le=10)
    seed: int = 0
    n_bootstrap: int = Field(1000, ge=0, description="at most max_bootstrap")

    @model_validator(mode="after")
    def _both_classes_in_both_splits(self) -> ProbeRequest:
        for split in ("train", "test"):
            labels = {i.label for i in self.items if i.split == split}
            if labels != {0, 1}:
                raise ValueError(f"items: the {split} split needs both labels 0 and 1, has {sorted(labels)}")
        return self


class ScoreRequest(BaseModel):
    model_config = _REQUEST
    concept: str = Field(description="a concept this service has a scorer for (see /healthz)")
    texts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")


class StoredVector(BaseModel):
    """A steering vector of the run this service was started with: the DiffMean of the run's pooled train vectors
    of `concept` under `strategy` at the request's `layer`, as the run's D2 stage builds it."""

    model_config = _REQUEST
    concept: str = Field(description="a concept of the run (see /healthz vectors)")
    strategy: str = Field("A1_mean", description="strategy id or short code the run pooled with")
    unit: Literal["residual", "raw"] = Field(
        "residual", description="residual: alpha in units of the layer's mean token residual norm, D2's alpha "
                                "(needs a D2 cell of the run at this concept and layer); raw: alpha times the "
                                "DiffMean vector itself")


class GenerateRequest(BaseModel):
    model_config = _REQUEST
    model: str = "embedded"
    prompts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")
    layer: int = Field(ge=0, description="the decoder layer whose output alpha * vector is added to")
    vector: list[float] | None = Field(None, description="a raw steering vector, hidden_size finite floats, added "
                                                         "as alpha * vector; null (and no stored): unsteered")
    stored: StoredVector | None = Field(None, description="or a stored vector of the service's run, by (concept, "
                                                          "strategy) at `layer`; not with `vector`")
    alpha: float = Field(0.0, description="finite; 0 or no vector: unsteered")
    max_new_tokens: int = Field(16, ge=1, description="at most max_new_tokens")
    temperature: float = Field(0.7, gt=0)
    greedy: bool = False
    seed: int = Field(0, description="prompt i samples with seed + i, whatever else is in the batch")

    @model_validator(mode="after")
    def _one_vector(self) -> GenerateRequest:
        if self.vector is not None and self.stored is not None:
            raise ValueError("give either vector (raw) or stored (a run's vector), not both")
        return self


class PoolResponse(BaseModel):
    model_id: str
    layer: int
    strategy: str
    dim: int
    vectors: list[list[float]] = Field(description="one pooled vector per text, in input order")
    fallback: list[bool] = Field(description="True where the strategy selected no token and fell back to A1")
    seconds: float


class ProbeScores(BaseModel):
    probe: str
    cv_auroc: float | None
    test_auroc: float | None
    ci_low: float | None
    ci_high: float | None
    ci_level: float | None
    n_train: int
    n_test: int
    fallback_rate: float


class ProbeResponse(BaseModel):
    model_id: str
    layer: int
    strategy: str
    probes: dict[str, ProbeScores] = Field(description="by probe name: logistic and diffmean")
    seconds: float


class ScoreResponse(BaseModel):
    concept: str
    scores: list[float] = Field(description="classifier B's P(concept | text) in [0, 1], one per text, in input "
                                            "order")
    heldout_auroc: float | None = Field(description="the scorer's AUROC on its concept's held-out split")


class GenerationOut(BaseModel):
    prompt: str
    text: str


class GenerateResponse(BaseModel):
    model_id: str
    layer: int
    alpha: float
    generations: list[GenerationOut]


class Health(BaseModel):
    status: str
    models: list[str]
    scorers: list[str]
    vectors: list[str] = Field(description="concepts whose stored vectors /generate can steer with")


def _one_line_validation(errors: list[dict]) -> str:
    """The first few pydantic errors as 'loc: message' in one line."""
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more


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

        strategy = _spec(req.strategy).id
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


def _check_sizes(settings: ServiceSettings, texts: list[str], what: str) -> None:
    if len(texts) > settings.max_texts:
        raise RequestError(f"{what}: {len(texts)} entries, at most {settings.max_texts} per request")
    long = [i for i, t in enumerate(texts) if len(t) > settings.max_chars]
    if long:
        raise RequestError(f"{what}[{long[0]}]: {len(texts[long[0]])} characters, at most {settings.max_chars}")


def _spec(strategy: str):
    from poolbench.pooler.registry import resolve_strategies

    return resolve_strategies([strategy])[0]


def _pool(loaded, settings: ServiceSettings, texts: list[str], labels: list[int], splits: list[str],
          groups: list[str | None], layer: int, strategy: str):
    """A PooledTable (and ITIHeadTable) for ad-hoc texts: the batch pipeline's pooling, one layer and strategy."""
    from poolbench.corpus.passage import Passage
    from poolbench.pooler.concept_pooling import pool_concept_tables

    if layer >= loaded.n_layers:
        raise RequestError(f"layer: {layer} out of range for '{loaded.model_id}' ({loaded.n_layers} layers)")
    passages = [Passage(id=f"t{i}", text=t, label=y, domain="http", token_count=0, matched_pair_id=g,
                        split=s, concept="http") for i, (t, y, s, g) in enumerate(zip(texts, labels, splits, groups,
                                                                                       strict=True))]
    return pool_concept_tables(loaded, passages, [layer], [_spec(strategy)], batch_size=settings.batch_size,
                               max_length=settings.max_length)


def limits_description(settings: ServiceSettings) -> str:
    """Every limit of this deployment, in words, for the OpenAPI description."""
    return (
        "Pooling, D1 probes, classifier B and steering.\n\n"
        "Limits of this deployment:\n"
        f"- request body: at most {settings.max_body_bytes} bytes, counted while it streams (chunked bodies too); "
        "over it: 413\n"
        f"- texts / items / prompts: at most {settings.max_texts} per request, each at most {settings.max_chars} "
        "characters; over it: 422\n"
        f"- /generate max_new_tokens: at most {settings.max_new_tokens}; vector: the model's hidden size; "
        f"stored vectors of the run for: {', '.join(sorted(settings.pooled_keys)) or 'none'} (others: 404)\n"
        f"- /probe n_bootstrap: at most {settings.max_bootstrap}; n_folds 2 to 10\n"
        "- every number must be finite: NaN and Infinity are refused with 422\n"
        f"- models: {', '.join(settings.models) or 'none'} (others: 404); "
        f"scorers: {', '.join(settings.scorer_concepts) or 'none'} (others: 404)\n"
        f"- per replica at most {settings.max_working} requests at once (waiting requests of one endpoint run as one "
        f"batch of up to {settings.batch_size}) and {settings.max_queued} queued; beyond that: 503 with Retry-After "
        "(seconds)")


def _schema_limits(settings: ServiceSettings) -> dict[str, dict[str, dict]]:
    """The runtime limits as JSON-schema keywords on the request models' fields."""
    texts = {"maxItems": settings.max_texts, "items": {"maxLength": settings.max_chars}}
    return {"PoolRequest": {"texts": texts}, "ScoreRequest": {"texts": texts},
            "GenerateRequest": {"prompts": texts, "max_new_tokens": {"maximum": settings.max_new_tokens}},
            "ProbeRequest": {"items": {"maxItems": settings.max_texts},
                             "n_bootstrap": {"maximum": settings.max_bootstrap}},
            "LabelledText": {"text": {"maxLength": settings.max_chars}}}


def _merge(target: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value


_ERRORS = {404: {"description": "model or scorer not served here"},
           413: {"description": "request body over max_body_bytes"},
           422: {"description": "invalid request (one-line detail)"}}


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
            if model not in self._engines:
                self._engines[model] = VLLMBackend(str(loaded.path), dtype=self.settings.dtype)
            return self._engines[model]


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


R = TypeVar("R")


def answer_grouped(reqs: Sequence[R], key: Callable[[R], str], use: Callable[[str], AbstractContextManager[Any]],
                   answer: Callable[[Any, list[R]], list]) -> list:
    """Requests grouped by the resource they name (a model, a scorer), each group answered under one hold of it;
    a resource that is not served or does not load answers every request of its group with that error."""
    out: list = [None] * len(reqs)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(key(r), []).append(i)
    for name, members in groups.items():
        try:
            with use(name) as resource:
                answers = answer(resource, [reqs[i] for i in members])
        except PoolBenchError as exc:
            answers = [exc] * len(members)
        for i, a in zip(members, answers, strict=True):
            out[i] = a
    return out


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


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: nobody else on the network can connect there."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Refuse, in one line, to listen beyond loopback with no token: the models would be open to the network."""
    if token is None and not is_loopback_host(host):
        raise ServiceConfigError(f"refusing to serve on {host} without a bearer token: pass --token or set "
                                 f"{TOKEN_ENV} (or listen on 127.0.0.1)")


def with_token(settings: ServiceSettings, token: str | None) -> ServiceSettings:
    """The settings with this bearer token (at least 16 characters), or one line saying why not."""
    if token is not None and len(token) < 16:
        raise ServiceConfigError(f"the bearer token has {len(token)} characters; use at least 16 "
                                 "(e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return settings.model_copy(update={"token": token})


def bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())


def _answer(result):
    """A batched call's answer, or its error raised for the exception handlers."""
    if isinstance(result, PoolBenchError):
        raise result
    return result


def _batched(many, settings: ServiceSettings, compute: ComputeThread):
    """`many` (a list of requests -> their answers, blocking) as an awaitable of one request on the app's compute
    thread, run together with the other requests of `many` waiting there (ComputeThread.submit_batch). Not
    `@serve.batch`: it cuts a batch from one wait window's arrivals and queues it behind the running one, so under
    load it ran /generate batches of 1.3 requests while 30 requests waited (bench/README.md)."""

    async def one(req):
        return (await asyncio.wrap_future(compute.submit_batch(many, [req], max_items=settings.batch_size)))[0]

    return one


def build_api(settings: ServiceSettings) -> FastAPI:
    """The FastAPI app (usable without Ray: tests and `uvicorn` can mount it directly)."""
    api = FastAPI(title="PoolBench", version="1", description=limits_description(settings))
    api.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    api.add_middleware(Admission, workers=settings.max_working, queue=settings.max_queued, open_paths=OPEN_PATHS)
    if settings.token is not None:
        token = settings.token

        @api.middleware("http")
        async def require_token(request: Request, call_next):  # added last: runs before the body is read
            if request.url.path in OPEN_PATHS or bearer_ok(request.headers.get("authorization"), token):
                return await call_next(request)
            return JSONResponse(status_code=401, content={"detail": "missing or wrong bearer token"},
                                headers={"WWW-Authenticate": "Bearer"})
    models = ModelCache(settings)
    engines = SteeringEngines(settings)
    # Every model call of this app on one thread (poolbench.compute_thread): request threads would each give
    # libgomp a team of OpenMP threads and throttle them all.
    compute = ComputeThread("poolbench-http")
    scorers = ScorerCache(settings)
    vectors = VectorCache(settings)
    plain_openapi = api.openapi

    def openapi_with_limits() -> dict:
        if api.openapi_schema is None:
            schemas = plain_openapi()["components"]["schemas"]
            for model, fields in _schema_limits(settings).items():
                for name, keywords in fields.items():
                    _merge(schemas[model]["properties"][name], keywords)
        return api.openapi_schema

    api.openapi = openapi_with_limits  # type: ignore[method-assign]

    @api.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        return JSONResponse(status_code=422, content={
            "detail": _one_line_validation(errors),
            "errors": [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in errors]})

    @api.exception_handler(NotServed)
    async def not_served(_: Request, exc: NotServed):
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    @api.exception_handler(ServiceConfigError)
    async def unavailable(_: Request, exc: ServiceConfigError):
        return JSONResponse(status_code=503, content={"detail": str(exc).splitlines()[0]})

    @api.exception_handler(PoolBenchError)
    async def poolbench_error(_: Request, exc: PoolBenchError):
        return JSONResponse(status_code=422, content={"detail": str(exc).splitlines()[0]})

    from poolbench.http.leaderboard_route import add_leaderboard_route

    add_leaderboard_route(api, settings.leaderboard)

    @api.get("/healthz")
    def healthz() -> Health:
        return Health(status="ok", models=list(settings.models), scorers=settings.scorer_concepts,
                      vectors=sorted(settings.pooled_keys))

    def pool_many(reqs: list[PoolRequest]) -> list[PoolResponse | PoolBenchError]:
        """A batch of /pool requests under one hold of each model's lock, one thread hop for all. Each request keeps
        its own forward pass: pooling texts of several requests together changes their vectors (padding; by up to
        0.06 in the embedded model's bfloat16, 1.5e-4 in float32), and an answer must not depend on its neighbours."""
        from poolbench.pooler.pooled_table import PooledTableView

        def answer(loaded, group: list[PoolRequest]) -> list[PoolResponse | PoolBenchError]:
            out: list[PoolResponse | PoolBenchError] = []
            for req in group:
                started, n = time.perf_counter(), len(req.texts)
                try:
                    strategy = _spec(req.strategy).id
                    table = _pool(loaded, settings, req.texts, [0] * n, ["test"] * n, [None] * n, req.layer,
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

    def score_many(reqs: list[ScoreRequest]) -> list[ScoreResponse | PoolBenchError]:
        """A batch of /score requests under one hold of each scorer's lock; each request scored on its own, as its
        answer alone would be (the scorer pads by length within a call)."""
        def answer(scorer, group: list[ScoreRequest]) -> list[ScoreResponse]:
            return [ScoreResponse(concept=req.concept, scores=scorer.score(req.texts).tolist(),
                                  heldout_auroc=scorer.info.get("heldout_auroc")) for req in group]

        return answer_grouped(reqs, lambda r: r.concept, scorers.use, answer)

    pool_batched, score_batched = _batched(pool_many, settings, compute), _batched(score_many, settings, compute)
    generate_batched = _batched(lambda reqs: generate_many(reqs, models=models, engines=engines, vectors=vectors),
                                settings, compute)

    @api.post("/pool", responses=_ERRORS)
    async def pool(req: PoolRequest) -> PoolResponse:
        """Pooled vectors of `texts` at one layer with one strategy, in input order (served in a batch with the
        /pool requests waiting with it; the answer is the same as alone)."""
        _check_sizes(settings, req.texts, "texts")
        spec = _spec(req.strategy)
        if spec.supervision != "none" or "corpus" in spec.needs:
            raise RequestError(f"strategy: {spec.id} needs labels or corpus statistics; use /probe or a run")
        return _answer(await pool_batched(req))

    @api.post("/probe", responses=_ERRORS)
    async def probe(req: ProbeRequest) -> ProbeResponse:
        """D1 of one cell on labelled texts: grouped CV AUROC on train, held-out AUROC with a bootstrap CI."""
        return await asyncio.wrap_future(compute.submit(probe_one, req))

    def probe_one(req: ProbeRequest) -> ProbeResponse:
        from poolbench.prober.concept_probe import probe_pooled_table

        _check_sizes(settings, [i.text for i in req.items], "items")
        if req.n_bootstrap > settings.max_bootstrap:
            raise RequestError(f"n_bootstrap: {req.n_bootstrap}, at most {settings.max_bootstrap}")
        spec = _spec(req.strategy)
        started = time.perf_counter()
        items = req.items
        with models.use(req.model) as loaded:
            pooled = _pool(loaded, settings, [i.text for i in items], [i.label for i in items],
                           [i.split for i in items], [i.group for i in items], req.layer, spec.id)
        # The reliability statistics are not part of the answer, so they are not computed.
        records = probe_pooled_table(pooled.pooled, "http", n_folds=req.n_folds, seed=req.seed,
                                     n_bootstrap=req.n_bootstrap, reliability=False, heads=pooled.heads)
        keep = set(ProbeScores.model_fields)
        return ProbeResponse(model_id=loaded.model_id, layer=req.layer, strategy=spec.id,
                             probes={r.probe: {k: getattr(r, k) for k in keep} for r in records},
                             seconds=time.perf_counter() - started)

    @api.post("/score", responses=_ERRORS)
    async def score(req: ScoreRequest) -> ScoreResponse:
        """Classifier B's P(concept | text) for each text, from the scorer configured (or run-recorded) for it
        (served in a batch with the /score requests waiting with it; the answer is the same as alone)."""
        _check_sizes(settings, req.texts, "texts")
        return _answer(await score_batched(req))

    @api.post("/generate", responses=_ERRORS)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        """Continuations with alpha * vector added to the output of `layer` (the steerer's backend); the /generate
        requests waiting together share one engine call, each row with its own vector, layer and seed (the answer
        is the same as alone)."""
        _check_sizes(settings, req.prompts, "prompts")
        if req.max_new_tokens > settings.max_new_tokens:
            raise RequestError(f"max_new_tokens: {req.max_new_tokens}, at most {settings.max_new_tokens}")
        return _answer(await generate_batched(req))

    return api


def serve_application(settings: ServiceSettings, *, num_cpus: float = 1.0):
    """The Serve application: one deployment whose ingress is the FastAPI app, built on each replica."""
    from ray import serve

    def build() -> FastAPI:
        return build_api(settings)

    # Serve forwards every request (a waiting one costs the replica an asyncio task); Admission decides who waits.
    ongoing = 2 * (settings.max_working + settings.max_queued) + 16

    @serve.deployment(name="PoolBenchIngress", num_replicas=1, max_ongoing_requests=ongoing,
                      ray_actor_options={"num_cpus": num_cpus,
                                         **({"num_gpus": 1} if settings.steering_backend == "vllm" else {})})
    @serve.ingress(build)
    class PoolBenchIngress:
        """Holds one replica's models and scorers; every route is the FastAPI handler."""

    return PoolBenchIngress.bind()


def start_serve(settings: ServiceSettings, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                num_cpus: float = 1.0) -> str:
    """Start Serve's HTTP proxy on host:port (Ray must be connected) and deploy; returns the base URL."""
    from ray import serve

    settings = with_token(settings, settings.token or os.environ.get(TOKEN_ENV) or None)
    check_exposure(host, settings.token)
    check_scorers(settings)
    serve.start(http_options={"host": host, "port": port})
    serve.run(serve_application(settings, num_cpus=num_cpus), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"
