"""First-order steerability on every cell at its chosen layer, and its rank agreement with D1, after D1: read
from the pooled shards and the gradient sums S2's extraction stored beside them (no model, no generation)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poolbench.pooler.gradient_sums import read_gradient_table
from poolbench.pooler.pooled_table import PooledTableView, read_pooled_layer
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.steerer.cell_steerability import SteerabilityCell, cell_steerability
from poolbench.steerer.steerability_rank import steerability_agreement
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import artifact_key

DEFINITION = ("first-order steerability S = r_L * (mean over test positives of u . G - the same over negatives), "
              "u the train DiffMean direction, r_L alpha's unit (the layer's residual norm on the train split), "
              "G = sum over a passage's tokens of d log p(passage) / d h_L: nats of log-likelihood per unit alpha "
              "(attribution patching, Nanda 2023; Kramar et al. 2024)")


def validation_key(weights_hash: str) -> str:
    """Where `make run-steerability` leaves its verdict for a model's weights, for every later run's answer."""
    return artifact_key("steerability_validation", weights=weights_hash)


def steerability_section(store: ArtifactStore, pooled_keys: Mapping[str, str], records: Sequence[D1CellRecord],
                         *, seed: int = 0, weights_hash: str | None = None) -> dict | None:
    """results.json's "steerability": every (concept, strategy) cell at the strategy's chosen layer, and
    Spearman(D1, S) per concept and overall, with the model's validation verdict where `make run-steerability`
    stored one; None when no shard has gradient sums (a run without S2)."""
    rows = build_leaderboard(records)["strategies"]
    cells: list[SteerabilityCell] = []
    any_gradients = False
    for concept, key in sorted(pooled_keys.items()):
        by_layer: dict[int, list[str]] = {}
        for row in rows:
            if concept in row["per_concept"]:
                by_layer.setdefault(int(row["best_layer"]), []).append(row["strategy"])
        for layer, strategies in sorted(by_layer.items()):
            gradients = read_gradient_table(store, key, layer)
            any_gradients |= gradients is not None
            view = PooledTableView(read_pooled_layer(store, key, layer))
            cells.extend(cell_steerability(view, gradients, concept, s, layer) for s in sorted(strategies))
    if not any_gradients:
        return None
    d1 = {c: {row["strategy"]: row["per_concept"][c]["auroc"] for row in rows if c in row["per_concept"]}
          for c in pooled_keys}
    steer: dict[str, dict[str, float | None]] = {}
    for cell in cells:
        steer.setdefault(cell.concept, {})[cell.strategy] = cell.steerability
    agreement = steerability_agreement(d1, steer, seed=seed)
    key = validation_key(weights_hash) if weights_hash else None
    validation = store.get_json(key) if key is not None and store.exists(key) else None
    return {"definition": DEFINITION, "cells": [c.to_record() for c in cells], "agreement": agreement.to_record(),
            "sentence": agreement.sentence(),
            "validation": None if not isinstance(validation, dict) else validation.get("verdict")}
