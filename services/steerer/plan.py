"""Which steering cells a run covers, with which settings, and how the leaderboard sums them up.

Default subset (keeps `make run` short on 2 CPU cores): concepts DEFAULT_STEERING_CONCEPTS, for each the
best and the worst (above chance) strategy of the D1 leaderboard at that strategy's D1-chosen layer, 20 prompts, 24 new
tokens. `full=True`: every concept x every strategy at its D1-chosen layer (all_layers=True: every layer),
FULL_N_PROMPTS prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from poolbench.records.d1 import cv_best_row
from poolbench.records.steering import D2Record, D3Record

from .backend import GenerationSettings
from .d3 import neighbour_map
from .errors import SteeringError
from .fluency import AUTO
from .prompts import load_prompts
from .run import SteeringConfig
from .vector import validate_alphas

# Their D3 neighbours overlap, so 3 concepts need 6 scorers: imdb_sentiment (narrative, frustration),
# frustration (deference, toxicity), toxicity (frustration, depression).
DEFAULT_STEERING_CONCEPTS = ("imdb_sentiment", "frustration", "toxicity")
CHANCE_D1 = 0.55
DEFAULT_RUN_CONFIG = SteeringConfig(n_prompts=20, settings=GenerationSettings(max_new_tokens=24))
FULL_N_PROMPTS = 50


def steering_config(full: bool, seed: int = 0, reference_model: str = AUTO) -> SteeringConfig:
    """The default subset's settings, or the full subset's (the same but FULL_N_PROMPTS prompts), with the run's
    seed for prompt seeds, the prompt halves and every bootstrap, and the fluency guard's reference model."""
    return replace(DEFAULT_RUN_CONFIG, n_prompts=FULL_N_PROMPTS if full else DEFAULT_RUN_CONFIG.n_prompts, seed=seed,
                   reference_model=reference_model)


@dataclass(frozen=True)
class SteeringCell:
    concept: str
    strategy: str
    layer: int
    why: str = ""


def choose_cells(leaderboard: dict, concepts: Sequence[str], *, full: bool = False, all_layers: bool = False,
                 subset: Sequence[str] = DEFAULT_STEERING_CONCEPTS) -> list[SteeringCell]:
    """Cells from the D1 leaderboard (build_leaderboard's dict): per default concept the best strategy, chosen on
    training CV as the answer's is (the held-out test never picks what is steered), and the worst informative one
    in the leaderboard's order; or every strategy of every concept with `full`."""
    rows = leaderboard.get("strategies", [])
    if not rows:
        raise SteeringError("the D1 leaderboard has no strategies to choose steering cells from")
    if full:
        cells = []
        for concept in concepts:
            for row in rows:
                layers = sorted(row["layer_curve"]) if all_layers else [row["best_layer"]]
                cells.extend(SteeringCell(concept, row["strategy"], int(L), "full") for L in layers)
        return cells
    chosen = [c for c in subset if c in concepts] or list(concepts)[:3]
    # A strategy at chance (P2_first on a causal LM pools the constant BOS state) has no steering vector;
    # "worst" is the worst strategy that carries any signal.
    best = cv_best_row(rows)
    others = [r for r in rows if r is not best]
    informative = [r for r in others if r["mean_d1"] >= CHANCE_D1] or others
    picks = [(best, "best D1")] + ([(informative[-1], "worst D1")] if informative else [])
    return [SteeringCell(c, row["strategy"], int(row["best_layer"]), why) for c in chosen for row, why in picks]


def rows_per_cell(config: SteeringConfig) -> int:
    """Rows one cell generates: its alpha grid x prompts, and its prompts again for the prompted baseline."""
    n = len(load_prompts(config.prompts_file, config.n_prompts))
    return len(validate_alphas(config.alphas)) * n + (n if config.prompted_baseline else 0)


def cells_per_call(config: SteeringConfig) -> int:
    """How many cells one engine call takes: their rows within `max_rows_per_call`, and each prompt's rows of all
    of them (one shared alpha = 0 row, the other alphas each cell's own) within one transformers chunk of
    `batch_size` rows, so a prompt's alpha rows stay paired in one batch. At least one."""
    settings = config.settings
    steered_alphas = len(validate_alphas(config.alphas)) - 1
    by_rows = settings.max_rows_per_call // rows_per_cell(config)
    by_chunk = (settings.batch_size - 1) // steered_alphas
    return max(1, min(by_rows, by_chunk))


def cell_groups(cells: Sequence[SteeringCell], *, engines: int, per_call: int) -> list[tuple[SteeringCell, ...]]:
    """Each engine's share of the cells (contiguous in the given, concept-major order, so a concept's cells share
    their prompted rows), cut into as few groups of at most `per_call` cells as it takes, sizes balanced."""
    shares = max(1, min(engines, len(cells)))
    groups: list[tuple[SteeringCell, ...]] = []
    for k in range(shares):
        share = cells[k * len(cells) // shares:(k + 1) * len(cells) // shares]
        n = math.ceil(len(share) / max(1, per_call))
        groups.extend(tuple(share[j * len(share) // n:(j + 1) * len(share) // n]) for j in range(n))
    return groups


def scorer_concepts(cells: Sequence[SteeringCell], available: Sequence[str]) -> list[str]:
    """Every concept whose scorer the cells need: their own and their D3 neighbours' present in the corpus."""
    table = neighbour_map()
    need = {c.concept for c in cells}
    for c in list(need):
        need.update(table.get(c, {}).values())
    return sorted(need & set(available))


def _mean(values: list) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def steering_summary(d2: Sequence[D2Record], d3: Sequence[D3Record]) -> dict[str, dict]:
    """Per strategy, for the leaderboard: mean SCP, Delta(alpha*), fluency ratio and relevance at alpha*
    over its non-null cells, mean Disent over non-null D3 records, and the counts behind them."""
    out: dict[str, dict] = {}
    for strategy in sorted({r.strategy for r in d2}):
        cells = [r for r in d2 if r.strategy == strategy]
        ok = [r for r in cells if r.status == "ok"]
        dis = [r for r in d3 if r.strategy == strategy]
        out[strategy] = {
            "mean_scp": _mean([r.scp for r in ok]), "mean_d2_delta": _mean([r.d2_delta for r in ok]),
            "mean_fluency_ratio": _mean([r.fluency_ratio for r in ok]),
            "mean_relevance": _mean([r.relevance for r in ok]),
            "mean_disent": _mean([r.disent for r in dis]), "mean_d3_rep": _mean([r.d3_rep for r in dis]),
            "n_cells": len(cells), "n_null_vectors": len(cells) - len(ok),
            "n_scp_ci_excludes_0": sum(1 for r in ok if (r.scp_ci_low or 0) > 0),
            "n_disent": sum(1 for r in dis if r.disent is not None),
            "per_concept": {r.concept: {"layer": r.layer, "scp": r.scp, "scp_ci_low": r.scp_ci_low,
                                        "scp_ci_high": r.scp_ci_high, "alpha_star": r.alpha_star,
                                        "d2_delta": r.d2_delta, "d2_delta_ci_low": r.d2_delta_ci_low,
                                        "d2_delta_ci_high": r.d2_delta_ci_high, "fluency_ratio": r.fluency_ratio,
                                        "relevance": r.relevance, "prompted_delta": r.prompted_delta,
                                        "status": r.status, "null_reason": r.null_reason}
                            for r in cells},
        }
    return out
