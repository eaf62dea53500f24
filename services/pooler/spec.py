"""StrategySpec and TokenContext: a pooling strategy is data (id, params and a weight rule), not a class."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

import numpy as np
import torch

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.sink import SINK_MODES

FAMILIES = frozenset({
    "position_anchored", "uniform_aggregation", "window", "saliency_weighted",
    "structural_linguistic", "oracle", "learned_aggregation", "other",
})
KINDS = frozenset({"weights", "reduction"})
REDUCTIONS = frozenset({"max", "min"})
# attention: per-head attention inflow at the probed layers; parse: spaCy words aligned to tokens;
# gradient: d(log-likelihood)/d(hidden) at the probed layers; corpus: statistics of the concept's train split
# (TF-IDF, unigram frequencies, trigger table); labels: supervised, finished per D1 fold by the prober;
# tokens: the tokenizer's own token strings (extras["token_root"], the reference's word-initial rule).
# token_states: every real token's states kept for the concept's forwards (learned aggregators fit on them).
NEEDS = frozenset({"attention", "parse", "gradient", "labels", "corpus", "tokens", "token_states"})
DIVISORS = frozenset({"weight_sum", "token_count"})
SUPERVISIONS = frozenset({"none", "labels"})

_ID_RE = re.compile(r"^(?P<code>[A-Z]{1,2}[0-9]{1,2})_[a-z0-9]+(?:_[a-z0-9]+)*$")
_PARAM_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")

ParamValue = int | float | str | bool


class HiddenOnDevice(Exception):
    """A weight rule read token states while they stay on the device: that batch pools on the host instead."""


class DeviceHidden:
    """TokenContext.hidden where token states never leave the device: any use raises HiddenOnDevice, so the
    pooler knows the rule reads them and pools that batch the reference way (on the host)."""

    def __getattr__(self, name: str):
        raise HiddenOnDevice(f"hidden.{name}")

    def __array__(self, *args, **kwargs):
        raise HiddenOnDevice("hidden as an array")

    def __getitem__(self, key):
        raise HiddenOnDevice("hidden[...]")

    def __len__(self) -> int:
        raise HiddenOnDevice("len(hidden)")


@dataclass(frozen=True)
class TokenContext:
    """Everything a weight function may look at for one padded batch; `rank` makes padding side irrelevant."""

    attention_mask: np.ndarray  # [B, T] bool, True on real tokens (special tokens included)
    special_mask: np.ndarray  # [B, T] bool
    offsets: np.ndarray  # [B, T, 2] int32
    input_ids: np.ndarray  # [B, T] int64
    texts: list[str]
    passage_ids: list[str]
    hidden: np.ndarray  # [L, B, T, d], for layer-dependent weights
    extras: Mapping[str, np.ndarray]
    lengths: np.ndarray  # [B] int64, real tokens per passage
    rank: np.ndarray  # [B, T] int64, index of a token among its passage's real tokens; -1 on padding

    @classmethod
    def from_batch(cls, batch: ActivationBatch) -> TokenContext:
        mask = np.asarray(batch.attention_mask, dtype=bool)
        rank = np.cumsum(mask, axis=1, dtype=np.int64) - 1
        rank[~mask] = -1
        lengths = mask.sum(axis=1, dtype=np.int64)
        rank.flags.writeable = lengths.flags.writeable = False  # shared by every spec of the batch
        return cls(
            attention_mask=mask, special_mask=np.asarray(batch.special_mask, dtype=bool),
            offsets=batch.offsets, input_ids=batch.input_ids, texts=batch.texts,
            passage_ids=batch.passage_ids, hidden=batch.hidden, extras=batch.extras,
            lengths=lengths, rank=rank,
        )

    @classmethod
    def from_arrays(cls, *, attention_mask: np.ndarray, special_mask: np.ndarray, offsets: np.ndarray,
                    input_ids: np.ndarray, texts: list[str], passage_ids: list[str],
                    extras: Mapping[str, np.ndarray]) -> TokenContext:
        """A context whose token states stay on the device (DeviceHidden): for weights built before a forward."""
        mask = np.asarray(attention_mask, dtype=bool)
        rank = np.cumsum(mask, axis=1, dtype=np.int64) - 1
        rank[~mask] = -1
        lengths = mask.sum(axis=1, dtype=np.int64)
        rank.flags.writeable = lengths.flags.writeable = False
        return cls(attention_mask=mask, special_mask=np.asarray(special_mask, dtype=bool), offsets=offsets,
                   input_ids=input_ids, texts=texts, passage_ids=passage_ids,
                   hidden=DeviceHidden(),  # type: ignore[arg-type]
                   extras=extras, lengths=lengths, rank=rank)

    @cached_property
    def token_norms(self) -> np.ndarray:
        """[L, B, T] L2 norm of every token's hidden state, computed once per batch for A4 and the sink rule."""
        return torch.linalg.vector_norm(torch.from_numpy(np.asarray(self.hidden)), dim=-1).numpy()


WeightsFn = Callable[[TokenContext], np.ndarray]


@dataclass(frozen=True)
class StrategySpec:
    """One pooling strategy. `weights_fn` returns unnormalised non-negative weights [B,T] or [L,B,T];
    the pooler masks, normalises and contracts them, so a strategy never touches the hidden-state maths."""

    id: str
    code: str
    family: str
    description: str
    kind: Literal["weights", "reduction"]
    weights_fn: WeightsFn | None = field(default=None, compare=False, repr=False)
    reduction: Literal["max", "min"] | None = None
    params: tuple[tuple[str, ParamValue], ...] = ()
    needs: frozenset[str] = frozenset()
    supervision: Literal["none", "labels"] = "none"
    reference_variant: bool = False
    version: int = 1
    variant_of: str | None = None  # a non-card variant of this card strategy id: runs only when named
    opt_in: bool = False  # listed with the card's, but runs only when named (not in a default run)
    # weights that are attention inflow averaged over "all" real queries or the "last" one: the sink rule
    # then also compares the first token's inflow with its uniform causal share (poolbench.pooler.sink)
    attention_queries: Literal["all", "last"] | None = None
    # what the weighted sum is divided by: the weights' sum (a weighted mean, every strategy but one) or the
    # passage's real-token count (the reference's A4_norm, a plain mean of rescaled tokens h_t / |h_t|)
    divide_by: Literal["weight_sum", "token_count"] = "weight_sum"

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem:
            raise StrategyError(f"strategy spec {self.id!r}: {problem}")

    def _problem(self) -> str | None:
        match = _ID_RE.match(self.id) if isinstance(self.id, str) else None
        if match is None:
            return "id must look like 'A1_mean' (code, underscore, lower_snake name)"
        if match["code"] != self.code:
            return f"code {self.code!r} does not match the id's prefix {match['code']!r}"
        if self.family not in FAMILIES:
            return f"unknown family {self.family!r} (known: {', '.join(sorted(FAMILIES))})"
        if not isinstance(self.description, str) or not 10 <= len(self.description) <= 500:
            return "description must be 10-500 characters"
        if self.kind not in KINDS:
            return f"kind must be 'weights' or 'reduction', got {self.kind!r}"
        if self.kind == "weights" and (not callable(self.weights_fn) or self.reduction is not None):
            return "kind 'weights' needs a callable weights_fn and no reduction"
        if self.kind == "reduction" and (self.reduction not in REDUCTIONS or self.weights_fn is not None):
            return "kind 'reduction' needs reduction 'max' or 'min' and no weights_fn"
        if not isinstance(self.params, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and _PARAM_NAME_RE.match(p[0])
            and isinstance(p[1], (int, float, str, bool)) for p in self.params
        ):
            return "params must be a tuple of (name, int|float|str|bool) pairs"
        if len({name for name, _ in self.params}) != len(self.params):
            return "params has a repeated name"
        if not isinstance(self.needs, frozenset) or not self.needs <= NEEDS:
            return f"needs must be a frozenset drawn from {sorted(NEEDS)}"
        if self.supervision not in SUPERVISIONS:
            return f"supervision must be 'none' or 'labels', got {self.supervision!r}"
        if self.supervision == "labels" and "labels" not in self.needs:
            return "supervision 'labels' requires 'labels' in needs"
        if self.variant_of is not None and (not isinstance(self.variant_of, str) or not _ID_RE.match(
                self.variant_of) or not self.variant_of.startswith(f"{self.code}_")):
            return f"variant_of must be the id of a strategy with code {self.code!r}, got {self.variant_of!r}"
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 1:
            return "version must be a positive int"
        if self.divide_by not in DIVISORS:
            return f"divide_by must be 'weight_sum' or 'token_count', got {self.divide_by!r}"
        if dict(self.params).get("sink", "keep") not in SINK_MODES:
            return f"param 'sink' must be one of {', '.join(SINK_MODES)}, got {dict(self.params)['sink']!r}"
        return None

    @property
    def sink_mode(self) -> str:
        """How the pooler treats the first real token (poolbench.pooler.sink); "keep" without a sink param."""
        return str(dict(self.params).get("sink", "keep"))

    def with_sink_mode(self, mode: str) -> StrategySpec:
        """The same strategy with another sink mode (its fingerprint, so its artifacts, differ)."""
        return replace(self, params=tuple(sorted({**dict(self.params), "sink": mode}.items())))

    def param(self, name: str) -> ParamValue:
        """A param's value; a weight rule's settings live here so they are part of the identity."""
        for key, value in self.params:
            if key == name:
                return value
        raise StrategyError(f"strategy {self.id!r} has no param {name!r}")

    def fingerprint(self) -> dict:
        """The canonical, JSON-able identity used in artifact keys: changing any of it invalidates caches."""
        return {"id": self.id, "params": {name: value for name, value in sorted(self.params)},
                "version": self.version}
