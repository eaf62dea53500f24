"""What an HTTP service may load and how big a request may be, fixed when the application is built; and the
scorers and steering vectors a finished run folder hands it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from poolbench.http.service_errors import ServiceConfigError


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
    steering_backend: Literal["transformers", "vllm"] = "transformers"  # vllm: /generate on a vLLM engine
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
    from poolbench.store.url import run_store_url

    store = run_store_url(doc)
    return {"scorer_store": store, "scorer_keys": keys}


def vectors_of_run(run: str | Path) -> dict:
    """{"vector_store", "pooled_keys", "residual_norms"} from a run's results.json: /generate can then steer with
    any (concept, strategy, layer) DiffMean vector of the run, alpha in the unit its D2 stage used."""
    _, doc = _run_document(run)
    keys = {c: a["pooled"] for c, a in (doc.get("artifacts") or {}).items() if a.get("pooled")}
    norms = {f"{r['concept']}/{r['layer']}": float(r["residual_norm"]) for r in doc.get("d2") or []
             if r.get("residual_norm") is not None}
    from poolbench.store.url import run_store_url

    store = run_store_url(doc)
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
