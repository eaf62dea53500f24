"""Reproduce profiles: the settings of a published run as a RunConfig, and the diff of a run against its numbers.

A profile is data (poolbench/data/<name>_profile.json): per model key its HF id, layers and the official board's
anonymised model name; the reference strategy id -> PoolBench id map; max length, dtype, model args, protocol.
The official D1 numbers are vendored beside it (poolbench_v1_official_d1.json, MIT, with its licence file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from poolbench.config import RunConfig
from poolbench.defaults import DEFAULT_PROTOCOL, check_protocol
from poolbench.errors import PoolBenchError

PROFILES = {"poolbench-v1": ("poolbench_v1_profile.json", "poolbench_v1_official_d1.json")}
# The stated tolerance of `reproduce --check`: |ours - official| per strategy's mean D1. Two sources of honest
# difference stay: bf16 forwards on other kernels and a GPU of another kind (a few 1e-3 of an AUROC over ~1,400
# passages), and S2's unigram counts over one concept instead of the run's set; 0.01 is far above the first and
# far below what a wrong rule moves (W4's five-chunk cap, L4's spaCy words: 0.01-0.1 of a mean D1).
CHECK_TOLERANCE = 0.01


class ProfileModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    hf_id: str
    layers: tuple[int, ...]
    official: str


class ReproduceProfile(BaseModel):
    """What a published run used, as `reproduce --profile` applies it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    models: dict[str, ProfileModel]
    max_length: int
    dtype: Literal["auto", "float32", "bfloat16", "float16"]
    model_args: dict[str, str]
    protocol: str  # one of PROTOCOLS (validated below), the run config's own form
    strategies: dict[str, str]  # reference id -> PoolBench id (several may share one: L2 runs as A1_ref_mean)
    not_reproduced: dict[str, str]
    notes: dict[str, str]

    @field_validator("protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        return check_protocol(value)


@dataclass(frozen=True)
class CheckRow:
    """One strategy of the diff: the official mean D1, ours (None when the run lacks it) and whether it is within."""

    reference_id: str
    strategy: str
    official: float | None
    ours: float | None
    within: bool | None  # None: nothing to compare (not run, or no official number)

    @property
    def difference(self) -> float | None:
        return None if self.official is None or self.ours is None else self.ours - self.official


def _data(name: str) -> dict:
    return json.loads(files("poolbench").joinpath("data", name).read_text())


@cache
def load_profile(name: str) -> tuple[ReproduceProfile, dict]:
    """The profile and its official numbers; an unknown name is one line naming the known ones."""
    if name not in PROFILES:
        raise PoolBenchError(f"unknown profile '{name}' (known: {', '.join(PROFILES)})")
    profile_file, official_file = PROFILES[name]
    raw = _data(profile_file)
    try:
        profile = ReproduceProfile(**{k: v for k, v in raw.items() if not k.startswith("_")})
    except ValidationError as exc:
        raise PoolBenchError(f"poolbench/data/{profile_file}: {exc.errors()[0]['msg']}") from exc
    return profile, _data(official_file)


def profile_model(profile: ReproduceProfile, model_key: str) -> ProfileModel:
    if model_key not in profile.models:
        raise PoolBenchError(f"profile '{profile.name}' has no model key '{model_key}' "
                             f"(known: {', '.join(profile.models)})")
    return profile.models[model_key]


def profile_config(profile: ReproduceProfile, model_key: str, *, corpus: str, out: str,
                   store: str | None = None, model: str | None = None, **overrides) -> RunConfig:
    """The RunConfig of one model of the profile; `model` (a local path) stands in for the HF id."""
    entry = profile_model(profile, model_key)
    strategies = tuple(dict.fromkeys(profile.strategies.values()))
    return RunConfig(model=model or entry.hf_id, model_args=dict(profile.model_args), dtype=profile.dtype,
                     corpus=corpus, layers=entry.layers, strategies=strategies, max_length=profile.max_length,
                     protocol=profile.protocol, store=store, out=out, steering=False, reliability=False,
                     **overrides)


def check_run(profile: ReproduceProfile, official: dict, model_key: str, leaderboard: dict,
              tolerance: float = CHECK_TOLERANCE) -> list[CheckRow]:
    """Per reference strategy: our mean D1 at the official run's best layer (the leaderboard's layer curve, the
    mean over concepts of each layer's D1) beside the official number. A board of another protocol is refused."""
    if leaderboard.get("protocol") != profile.protocol:
        raise PoolBenchError(f"this run's D1 is protocol '{leaderboard.get('protocol') or DEFAULT_PROTOCOL}'; the "
                             f"official numbers are protocol '{profile.protocol}': rerun with `reproduce`")
    entry = profile_model(profile, model_key)
    board = official["models"][entry.official]
    layer = board["best_layer"]
    numbers = board["D1_mean_auroc_per_strategy"]
    rows_by_id = {row["strategy"]: row for row in leaderboard.get("strategies", [])}
    out = []
    for reference_id in official["strategies"]:
        strategy = profile.strategies.get(reference_id, "")
        row = rows_by_id.get(strategy)
        curve = (row or {}).get("layer_curve", {})
        ours = curve.get(str(layer), curve.get(layer)) if row is not None else None
        theirs = numbers.get(reference_id)
        within = None if ours is None or theirs is None else abs(float(ours) - float(theirs)) <= tolerance
        out.append(CheckRow(reference_id, strategy or "-", theirs, None if ours is None else float(ours), within))
    return out
