"""Leaderboard: per strategy, one layer chosen on training data only, and its held-out D1 per concept."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from poolbench.defaults import DEFAULT_PROTOCOL, PB_PROTOCOL
from poolbench.prober.reliability import cv_best_layer
from poolbench.prober.verdicts import choose_on_cv
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.results.answer.near_ties import cv_auroc_step, layer_near_tie

PRIMARY_PROBE = "logistic"
FALLBACK_FLAG_RATE = 0.5

BEST_SELECTION = (
    "the best strategy is the one with the highest mean out-of-fold AUROC over concepts at its CV-chosen layer "
    "(training data only); rows are in held-out order, and the answer says whether the test confirms the choice"
)
LAYER_SELECTION = (
    "per strategy, the layer with the highest mean out-of-fold (train-split, pair-grouped CV) AUROC over "
    "concepts; D1 is the held-out test AUROC at that layer, so the test split never chooses the layer"
)
PB_LAYER_SELECTION = (
    "protocol pb (the official leaderboard's): D1 is the out-of-fold DiffMean AUROC of the train split "
    "(StratifiedKFold(5, shuffle, seed 42), rows L2-normalised); no held-out test, so every number is "
    "cross-validated only; with several layers run, the layer is the one with the highest mean of that AUROC"
)
# What the rows are ranked on (`ranked_on`): the declared tier estimand where the run has it for every strategy
# (docs/tiers.md), else the held-out AUROC over the test split as it is, whatever its tiers' blend.
RANKED_ON_MIX = "tier_mixed_d1"
RANKED_ON_BLEND = "test_auroc"
RANKING = {
    RANKED_ON_MIX: "mean over concepts of D1_mix (within-tier held-out AUROCs at the declared mix) at each "
                   "strategy's CV-chosen layer; mean_d1, the overall held-out AUROC that blends the tiers at the "
                   "test split's own mix, is shown beside it",
    RANKED_ON_BLEND: "mean over concepts of the held-out AUROC at each strategy's CV-chosen layer",
}


def cells_protocol(cells: Iterable[D1CellRecord]) -> str:
    """The protocol of a run's D1 cells ("poolbench" or "pb"); one run never mixes them."""
    found = {cell.protocol or DEFAULT_PROTOCOL for cell in cells}  # a record leaves PoolBench's own unnamed
    return found.pop() if len(found) == 1 else DEFAULT_PROTOCOL


def build_leaderboard(cells: Iterable[D1CellRecord], probe: str | None = None,
                      strategy_info: Mapping[str, dict] | None = None, *,
                      win_rate: Mapping[str, float | None] | None = None,
                      average_ranks: Mapping[str, float] | None = None,
                      sections: Mapping[str, object] | None = None,
                      lexical: Sequence[LexicalBaselineRecord] | None = None,
                      estimand: Mapping | None = None) -> dict:
    """Rank strategies by mean held-out D1 over concepts at each strategy's CV-selected layer.

    Given them, each row also gets its win rate and Friedman average rank, each concept its lexical baseline's
    AUROC (`lexical_auroc`, beside D1), and `sections` (provenance, steering) follow the rows: the finished
    leaderboard, never edited afterwards. `probe` defaults to the logistic probe, and to diffmean for cells of
    protocol pb (the only probe that protocol has); the board records the protocol of its numbers."""
    cells = list(cells)
    protocol = cells_protocol(cells)
    probe = probe or ("diffmean" if protocol == PB_PROTOCOL else PRIMARY_PROBE)
    lexical_by = {r.concept: r for r in lexical or ()}
    by_strategy: dict[str, dict[int, dict[str, D1CellRecord]]] = defaultdict(lambda: defaultdict(dict))
    for cell in cells:
        if cell.probe == probe:
            by_strategy[cell.strategy][cell.layer][cell.concept] = cell
    rows = []
    for strategy, layers in by_strategy.items():
        best_layer, concepts = cv_best_layer({L: {c: r.cv_auroc for c, r in by.items()} for L, by in layers.items()})
        if best_layer is None:
            continue
        chosen = layers[best_layer]
        per_concept = {
            c: {
                "auroc": chosen[c].test_auroc,
                "ci_low": chosen[c].ci_low,
                "ci_high": chosen[c].ci_high,
                "cv_auroc": chosen[c].cv_auroc,
                "fallback_rate": chosen[c].fallback_rate,
                **({"lexical_auroc": lexical_by[c].test_auroc} if c in lexical_by else {}),
            }
            for c in concepts
        }
        flagged = sorted(c for c, v in per_concept.items() if v["fallback_rate"] > FALLBACK_FLAG_RATE)
        curve = {int(L): float(np.mean([layers[L][c].cv_auroc for c in concepts])) for L in sorted(layers)}
        steps = {c: cv_auroc_step(chosen[c].n_train or 0, chosen[c].n_folds or 0) for c in concepts
                 if (chosen[c].n_train or 0) >= 2 and (chosen[c].n_folds or 0) >= 1}
        near_tie = layer_near_tie(curve, int(best_layer), steps) if len(steps) == len(concepts) else None
        info = (strategy_info or {}).get(strategy, {})
        rows.append({
            "strategy": strategy,
            **{k: info[k] for k in ("family", "supervision", "reference_variant") if k in info},
            "mean_d1": float(np.mean([v["auroc"] for v in per_concept.values()])),
            "mean_cv_auroc": float(np.mean([v["cv_auroc"] for v in per_concept.values()])),
            "best_layer": int(best_layer),
            "layer_curve": curve,
            "layer_near_tie": near_tie.to_dict() if near_tie is not None else None,
            "fallback_flagged_concepts": flagged,
            "per_concept": per_concept,
            "protocol": protocol,
        })
    ranked_on = _attach_estimand(rows, estimand)
    key = "d1_mix" if ranked_on == RANKED_ON_MIX else "mean_d1"
    rows.sort(key=lambda r: (-r[key], r["strategy"]))
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
        if win_rate is not None:
            row["win_rate"] = win_rate.get(row["strategy"])
        if average_ranks is not None:
            row["average_rank"] = average_ranks.get(row["strategy"])
    baseline = {"lexical_baseline": {c: {"auroc": r.test_auroc, "ci_low": r.ci_low, "ci_high": r.ci_high}
                                     for c, r in lexical_by.items()}} if lexical_by else {}
    chosen = {"best_on_cv": choose_on_cv({r["strategy"]: r["mean_cv_auroc"] for r in rows}),
              "best_selection": BEST_SELECTION} if rows else {}
    return {"probe": probe, "protocol": protocol,
            "layer_selection": PB_LAYER_SELECTION if protocol == PB_PROTOCOL else LAYER_SELECTION, **chosen,
            "ranked_on": ranked_on, "ranking": RANKING[ranked_on], **_estimand_gap(rows, estimand, ranked_on),
            "strategies": rows, **baseline, **(sections or {})}


def _attach_estimand(rows: list[dict], estimand: Mapping | None) -> str:
    """Put each row's D1_mix (mean, interval, per concept) on it and say what the rows rank on: the estimand when
    it covers every strategy at its CV-chosen layer, else the blend."""
    by = {(r["strategy"], int(r["layer"])): r for r in (estimand or {}).get("rows") or []}
    if not rows or any((row["strategy"], int(row["best_layer"])) not in by for row in rows):
        return RANKED_ON_BLEND
    for row in rows:
        mix = by[(row["strategy"], int(row["best_layer"]))]
        row.update(d1_mix=float(mix["d1_mix"]), d1_mix_ci_low=mix["ci_low"], d1_mix_ci_high=mix["ci_high"],
                   d1_mix_concepts=int(mix["n_concepts"]))
        for concept, value in mix["per_concept"].items():
            if concept in row["per_concept"]:
                row["per_concept"][concept]["d1_mix"] = float(value)
    return RANKED_ON_MIX


def _estimand_gap(rows: list[dict], estimand: Mapping | None, ranked_on: str) -> dict:
    """`estimand_missing`: the strategies whose CV-chosen layer has no D1_mix, where the run declared the estimand
    but ranks on the blend because of them (so a reader is told why the order is not the declared one)."""
    if ranked_on == RANKED_ON_MIX or not (estimand or {}).get("rows"):
        return {}
    by = {(r["strategy"], int(r["layer"])) for r in estimand["rows"]}
    return {"estimand_missing": sorted(r["strategy"] for r in rows if (r["strategy"], int(r["best_layer"])) not in by)}


def ranked_on_text(leaderboard: Mapping) -> str:
    """What a leaderboard's order is, in words for a caption: the declared estimand or the held-out blend."""
    if leaderboard.get("ranked_on") == RANKED_ON_MIX:
        mix = ", ".join(f"{t} {w:g}" for t, w in ((leaderboard.get("estimand") or {}).get("mix") or {}).items())
        return (f"ranked on the declared estimand D1_mix (within-tier held-out AUROCs mixed {mix}); mean D1, the "
                "overall held-out AUROC, blends the tiers at the test split's own mix")
    missing = leaderboard.get("estimand_missing")
    if missing:
        return ("ranked on mean held-out D1 (test AUROC), which blends the tiers at the test split's own mix: the "
                f"declared estimand D1_mix has no value for {', '.join(missing)} at the CV-chosen layer")
    return "ranked on mean held-out D1 (test AUROC)"


def leaderboard_rows(leaderboard: dict, concepts: Sequence[str] | None = None) -> list[list[str]]:
    """Plain string rows (rank, strategy, mean D1, layer, worst concept with its lexical baseline when the run
    has one) for a terminal table."""
    rows = []
    for row in leaderboard["strategies"]:
        worst = min(row["per_concept"].items(), key=lambda kv: kv[1]["auroc"])
        rows.append([
            str(row["rank"]), row["strategy"], f"{row['mean_d1']:.3f}", f"{row['mean_cv_auroc']:.3f}",
            str(row["best_layer"]), f"{worst[0]} {worst[1]['auroc']:.2f}" + (
                f" (lexical {worst[1]['lexical_auroc']:.2f})" if "lexical_auroc" in worst[1] else ""),
            ", ".join(row["fallback_flagged_concepts"]) or "-",
        ])
    return rows
