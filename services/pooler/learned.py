"""The learned-aggregation family (LA1-LA4): strategies that train, fitted per D1 fold where the token states are.

Pooling keeps each passage's real-token states on the model's device for the concept's forwards, then fits every
learned aggregator once per outer fit (learned_fits.outer_fit_rows: each CV fold's training part, and the whole
train split), with hyperparameters by inner CV on that fit's rows only. Only pooled vectors leave: the
LearnedFoldTable (passage, layer, strategy, fit, vector) holds every fit's pooled vector of every passage, and the
PooledTable's row of the strategy holds the whole-train fit's (the vectors the held-out test is read on and D2's
DiffMean direction is taken from). The prober picks, inside each fold, the fit trained on that fold's training
part (poolbench.prober.learned_cell), so no label of a scored passage shaped its features.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from poolbench.corpus.passage import Passage
from poolbench.errors import StoreError
from poolbench.extractor.padded_batches import host_to_device
from poolbench.pooler.learned_aggregators import AggregatorParams
from poolbench.pooler.learned_fits import TrainSettings, fit_outer, outer_fit_rows, pad_tokens, standardised
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.pooler.spec import StrategySpec, TokenContext
from poolbench.store.keys import artifact_key

FITS_META = ":learned_fits"  # PooledTable / LearnedFoldTable metadata "<strategy>:learned_fits": JSON per fit


def learned_table_key(pooled_key: str) -> str:
    """The LearnedFoldTable artifact that belongs to the PooledTable shard stored under `pooled_key`."""
    return artifact_key("learned_folds", pooled=pooled_key)


def is_learned(spec: StrategySpec) -> bool:
    return "token_states" in spec.needs


def needs_learned_table(pooled: pa.Table) -> bool:
    """True when the PooledTable holds a learned aggregator whose per-fit vectors live in a LearnedFoldTable."""
    return any(key.decode().endswith(FITS_META) for key in (pooled.schema.metadata or {}))


def _mean_placeholder(context: TokenContext) -> np.ndarray:
    """The in-forward weights of a learned strategy (its row is replaced by the fitted pooling afterwards)."""
    return context.attention_mask.astype(np.float32)


def grid_of(spec: StrategySpec) -> list[AggregatorParams]:
    """The spec's hyperparameter grid: "name:v1|v2;name:v1" -> the product of the listed values."""
    points: list[dict] = [{}]
    for part in str(spec.param("grid")).split(";"):
        name, values = part.split(":")
        kind = {"heads": int, "window": int, "temperature": float, "position_bias": lambda v: v == "1"}[name]
        points = [{**p, name: kind(v)} for p in points for v in values.split("|")]
    return [AggregatorParams(**p) for p in points]


def settings_of(spec: StrategySpec) -> TrainSettings:
    return TrainSettings(max_steps=int(spec.param("max_steps")), l2=float(spec.param("l2")))


def _spec(code: str, name: str, kind: str, grid: str, description: str) -> StrategySpec:
    return StrategySpec(
        id=f"{code}_{name}", code=code, family="learned_aggregation", kind="weights", weights_fn=_mean_placeholder,
        needs=frozenset({"labels", "token_states"}), supervision="labels", opt_in=True, description=description,
        params=(("aggregator", kind), ("folds", 5), ("fold_seed", 0), ("grid", grid), ("l2", 1e-3),
                ("max_steps", 100)),
    )


SPECS = (
    _spec("LA1", "attention_probe", "attention", "heads:1|4;position_bias:0|1",
          "Attention probe: learned queries (1 or 4 heads, optional position bias) softmax-weight the tokens "
          "(McKenzie et al., NeurIPS 2025; EleutherAI attention probes, 2025). Fitted per D1 fold."),
    _spec("LA2", "softmax_probe", "softmax", "temperature:1|4",
          "Softmax probe: per-token logits, pooled with their softmax as weights (McKenzie et al., NeurIPS 2025). "
          "Fitted per D1 fold."),
    _spec("LA3", "multimax", "multimax", "heads:1|4",
          "MultiMax: 1 or 4 heads, each a hard max over per-token scores; pools each head's argmax token "
          "(Kramar et al., arXiv 2601.11516, 2026). Fitted per D1 fold."),
    _spec("LA4", "rolling_max", "rolling", "window:3|8",
          "Rolling mean then max: per-token logits averaged over a 3- or 8-token window, the best window pooled "
          "(Kramar et al., arXiv 2601.11516, 2026). Fitted per D1 fold."),
)


class TokenKeeper:
    """Wraps a chunk's capture sink: passes every layer on, and keeps each row's real, non-special token states
    (float32, on their device) so the concept's learned aggregators can be fitted after its forwards.

    The kept tokens are found on the host, once a chunk: one gather a layer by their flat positions (sent to the
    device page-locked, without waiting) and a split by each row's count. A boolean index a row (before) is a
    nonzero on the device, which on a GPU waited for the device's queue rows x layers times a chunk, inside the
    capture's forward."""

    def __init__(self, sink, chunk, layers: Sequence[int]) -> None:
        self.sink = sink
        self._chunk = chunk
        keep = np.asarray(chunk.attention_mask, bool) & ~np.asarray(chunk.special_mask, bool)
        keep |= ~keep.any(axis=1, keepdims=True) & np.asarray(chunk.attention_mask, bool)
        self._positions = np.flatnonzero(keep).astype(np.int64, copy=False)  # row b's kept tokens, then row b + 1's
        self._counts = [int(n) for n in keep.sum(axis=1)]
        self._index: torch.Tensor | None = None
        self.states: dict[int, list[torch.Tensor]] = {int(layer): [] for layer in layers}

    def __call__(self, layer: int, hidden: torch.Tensor, extras) -> None:
        self.sink(layer, hidden, extras)
        if self._index is None or self._index.device != hidden.device:
            self._index = host_to_device(self._positions, hidden.device)
        kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._index).float()
        self.states[int(layer)] = list(torch.split(kept, self._counts))

    def __getattr__(self, name: str):
        return getattr(self.sink, name)


@dataclass(frozen=True)
class LearnedPooling:
    """One concept's learned pooling at one layer: per strategy the whole-train fit's vectors [N, d] (PooledTable
    rows, in `passage_ids` order) and the LearnedFoldTable of every fit."""

    passage_ids: list[str]
    final: dict[str, np.ndarray]
    table: pa.Table
    fits: dict[str, str]  # strategy -> JSON of its fits (training ids, chosen grid point, steps, inner AUROC)


def learned_schema(hidden_size: int) -> pa.Schema:
    return pa.schema([pa.field("passage_id", pa.string()), pa.field("layer", pa.int16()),
                      pa.field("strategy", pa.string()), pa.field("fit", pa.int16()),
                      pa.field("vector", pa.list_(pa.float32(), hidden_size))])


def fit_learned_layer(passages: Sequence[Passage], states: Sequence[torch.Tensor], layer: int,
                      specs: Sequence[StrategySpec]) -> LearnedPooling:
    """Fit every learned spec at one layer on a concept's passages (their token states in the same order). Token
    states are standardised by the train split's tokens (no labels read), the same for every fit."""
    y = np.array([p.label for p in passages], dtype=np.int64)
    groups = np.array([p.group for p in passages])
    train = np.flatnonzero(np.array([p.split == "train" for p in passages]))
    raw = pad_tokens(states)
    scaled = standardised(raw, train)
    ids = [p.id for p in passages]
    dim = raw.Z.shape[-1]
    final, fits, batches = {}, {}, []
    for spec in specs:
        fit_sets = outer_fit_rows(y, groups, train, int(spec.param("folds")), int(spec.param("fold_seed")))
        outer = fit_outer(str(spec.param("aggregator")), grid_of(spec), scaled, y, groups, fit_sets,
                          settings_of(spec), seed=int(spec.param("fold_seed")))
        stacked = torch.stack([torch.einsum("nt,ntd->nd", fit.weights, raw.Z) for fit in outer]).cpu().numpy()
        described = [{"fit": k, "train": sorted(ids[i] for i in rows), "params": fit.params.describe(),
                      "steps": fit.steps, "inner_loss": fit.inner_loss}
                     for k, (rows, fit) in enumerate(zip(fit_sets, outer, strict=True))]
        final[spec.id] = stacked[-1]
        fits[spec.id] = json.dumps(described)
        n_fits, n = stacked.shape[:2]
        batches.append(pa.RecordBatch.from_pydict({
            "passage_id": pa.array(ids * n_fits, pa.string()),
            "layer": pa.array(np.full(n_fits * n, layer, dtype=np.int16)),
            "strategy": pa.array([spec.id] * (n_fits * n), pa.string()),
            "fit": pa.array(np.repeat(np.arange(n_fits, dtype=np.int16), n)),
            "vector": pa.FixedSizeListArray.from_arrays(
                pa.array(np.ascontiguousarray(stacked, np.float32).reshape(-1), pa.float32()), dim),
        }, schema=learned_schema(dim)))
    metadata = {f"{sid}{FITS_META}": text for sid, text in fits.items()}
    table = pa.Table.from_batches(batches, schema=learned_schema(dim).with_metadata(metadata))
    return LearnedPooling(ids, final, table, fits)


class LearnedFoldView:
    """Decodes a LearnedFoldTable and hands out one (layer, strategy) cell's fits in a given passage order."""

    def __init__(self, table: pa.Table) -> None:
        vector = table.column("vector").combine_chunks()
        self._X = vector.values.to_numpy(zero_copy_only=False).reshape(len(vector), vector.type.list_size)
        self._cols = {name: table.column(name).to_numpy(zero_copy_only=False)
                      for name in ("passage_id", "layer", "strategy", "fit")}
        self._meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}

    def fits(self, strategy: str) -> list[dict]:
        return json.loads(self._meta[f"{strategy}{FITS_META}"])

    def cell(self, layer: int, strategy: str, passage_ids: np.ndarray) -> np.ndarray:
        """[fits, N, d] float32, rows in the order of `passage_ids`."""
        c = self._cols
        rows = np.flatnonzero((c["layer"] == layer) & (c["strategy"] == strategy))
        n_fits = len(self.fits(strategy))
        position = {pid: i for i, pid in enumerate(passage_ids)}
        out = np.full((n_fits, len(passage_ids), self._X.shape[1]), np.nan, dtype=np.float32)
        for r in rows:
            i = position.get(c["passage_id"][r])
            if i is not None:
                out[int(c["fit"][r]), i] = self._X[r]
        if np.isnan(out).any():
            raise StoreError(f"LearnedFoldTable: {strategy} layer {layer} does not hold every fit of every passage "
                             "of its PooledTable")
        return out


class LearnedStates:
    """The kept token states of a pooling job's passages (by their index in the job), layer by layer."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.by_layer: dict[int, dict[int, torch.Tensor]] = {int(layer): {} for layer in layers}

    def add(self, chunk, keeper: TokenKeeper) -> None:
        for layer, states in keeper.states.items():
            for row, index in enumerate(chunk.indices):
                self.by_layer[layer][int(index)] = states[row]

    def fit_member(self, passages: Sequence[Passage], first: int, tables: dict[int, pa.Table],
                   specs: Sequence[StrategySpec], hidden_size: int) -> tuple[dict[int, pa.Table], dict[int, pa.Table]]:
        """One concept's PooledTables with its learned rows replaced by the whole-train fits, and its
        LearnedFoldTable per layer. Passages without states (skipped as too long) are left out, as pooling does."""
        out, learned = {}, {}
        for layer, table in tables.items():
            states = self.by_layer[layer]
            kept = [(p, states[first + i]) for i, p in enumerate(passages) if first + i in states]
            pooling = fit_learned_layer([p for p, _ in kept], [s for _, s in kept], layer, specs)
            builder = PooledTableBuilder([p for p, _ in kept], hidden_size)
            vectors = np.stack([pooling.final[spec.id] for spec in specs])[None]  # [1, S, N, d]
            builder.add(vectors, [layer], [spec.id for spec in specs], pooling.passage_ids,
                        np.zeros(vectors.shape[1:3], dtype=bool))
            ids = pa.array([spec.id for spec in specs], pa.string())
            others = table.filter(pc.invert(pc.is_in(table.column("strategy"), value_set=ids)))
            metadata = {**{k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()},
                        **{f"{spec.id}{FITS_META}": str(len(json.loads(pooling.fits[spec.id]))) for spec in specs}}
            joined = pa.concat_tables([others, builder.table().cast(others.schema)])
            out[layer] = joined.replace_schema_metadata(metadata)
            learned[layer] = pooling.table
        return out, learned
