"""The reliability statistics around D1: per cell (seeds, selectivity, MDL) and across cells (win rate,
Friedman + Nemenyi). Arrays and records in, flat JSON-able dicts out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from poolbench.prober.auroc import ProbeError
from poolbench.prober.d1 import check_split
from poolbench.prober.fast_folds import check_folds
from poolbench.prober.mdl import OnlineCode, online_codelength
from poolbench.prober.seed_spread import SeedSpread, seed_spread
from poolbench.prober.selectivity import CONTROL_TASK, Selectivity, selectivity
from poolbench.prober.significance import friedman_nemenyi
from poolbench.prober.win_rate import mean_win_rate

RELIABILITY_VERSION = 3  # 3: control task per lexical type with pair-grouped folds (n/a without types), MDL >= 5 blocks
RELIABILITY_PROBE = "logistic"
LAYER_SELECTION = (
    "each strategy at its CV-chosen layer (highest mean cv_auroc over concepts, ties to the lower layer), "
    "the layer the leaderboard reports it at"
)
_BLAS = ThreadpoolController()


def cell_reliability(X_train: np.ndarray, y_train: np.ndarray, groups_train: np.ndarray,
                     ids_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray, groups_test: np.ndarray,
                     *, seed: int, n_seeds: int = 5, n_folds: int = 5,
                     types_train: np.ndarray | None = None, d1_cv_auroc: float | None = None) -> dict:
    """Seed spread of CV AUROC, selectivity and MDL compression of D1's logistic probe on one cell.

    The test split is only validated here (the statistics live on train, so they never touch D1's
    held-out judgement). Every fit is D1's probe from scratch, so seed_cv_aurocs[0] is D1's cv_auroc.
    `types_train` (each train passage's lexical type, its domain) carries the control task; without it selectivity
    is None with the reason. `d1_cv_auroc`, D1's logistic cv_auroc of this cell at `seed`, stands in for seed
    `seed`'s five fits (the same fits; a test holds them equal). `ids_train` is kept for callers; the control no
    longer keys on passage ids.
    """
    X_train, y_train, groups_train = check_split("train", X_train, y_train, groups_train)
    X_test, y_test, groups_test = check_split("test", X_test, y_test, groups_test)
    if X_train.shape[1] != X_test.shape[1]:
        raise ProbeError(f"train has {X_train.shape[1]} features but test has {X_test.shape[1]}")
    check_folds(y_train, groups_train, n_folds)
    with _BLAS.limit(limits=1, user_api="blas"):
        spread = seed_spread(X_train, y_train, groups_train, seed=seed, n_seeds=n_seeds, n_folds=n_folds,
                             first=d1_cv_auroc)
        sel = selectivity(X_train, y_train, groups_train, types_train, seed=seed, n_folds=n_folds,
                          true_score=float(spread.cv_aurocs[0]))
        code = online_codelength(X_train, y_train, groups_train, seed=seed)
    return reliability_stats(spread, sel, code)


def reliability_stats(spread: SeedSpread, sel: Selectivity, code: OnlineCode) -> dict:
    """The record fields of one cell's seed spread, selectivity and MDL code (the batched path's too)."""
    return {
        "reliability_probe": RELIABILITY_PROBE,
        "seed_cv_aurocs": [float(v) for v in spread.cv_aurocs],
        "seed_mean": spread.mean,
        "seed_std": spread.std,
        "selectivity": sel.selectivity,
        "control_cv_auroc": sel.control_score,
        "control_ci_low": sel.control_ci_low,
        "control_ci_high": sel.control_ci_high,
        "control_task": CONTROL_TASK,
        "selectivity_na_reason": sel.na_reason,
        "mdl_compression": code.compression,
        "mdl_online_bits": code.online_bits,
        "mdl_uniform_bits": code.uniform_bits,
        "mdl_block_ends": [int(v) for v in code.block_ends],
        "mdl_block_bits": [float(v) for v in code.block_bits],
        "mdl_na_reason": code.na_reason,
    }


def score_matrix(records: Iterable[dict], *, metric: str = "test_auroc", probe: str = RELIABILITY_PROBE,
                 unit: Sequence[str] = ("concept", "layer")) -> tuple[list[tuple], list[str], np.ndarray]:
    """(units, strategies, scores [n_units, n_strategies]) from D1 records; NaN where a cell is missing."""
    cells: dict[tuple, dict[str, float]] = {}
    strategies: set[str] = set()
    for rec in records:
        if rec.get("probe", probe) != probe:
            continue
        cells.setdefault(tuple(rec[k] for k in unit), {})[rec["strategy"]] = float(rec[metric])
        strategies.add(rec["strategy"])
    units, names = sorted(cells), sorted(strategies)
    table = np.array([[cells[u].get(s, np.nan) for s in names] for u in units], dtype=np.float64)
    return units, names, table.reshape(len(units), len(names))


def cv_chosen_layers(records: Iterable[dict], probe: str = RELIABILITY_PROBE) -> dict[str, int]:
    """Per strategy, the layer with the highest mean cv_auroc over the concepts run at every one of its layers.

    The leaderboard's rule (results.answer.leaderboard.build_leaderboard), ties to the lower layer: the training
    split picks the layer, so the held-out scores compared across strategies never chose it.
    """
    scores: dict[str, dict[int, dict[str, float]]] = {}
    for rec in records:
        if rec.get("probe", probe) != probe:
            continue
        if rec.get("cv_auroc") is None:
            raise ProbeError(f"record of {rec['strategy']} at layer {rec['layer']} on {rec['concept']} has no "
                             "cv_auroc to choose its layer by")
        by_layer = scores.setdefault(rec["strategy"], {})
        by_layer.setdefault(int(rec["layer"]), {})[rec["concept"]] = float(rec["cv_auroc"])
    chosen = {}
    for strategy, layers in scores.items():
        layer, _ = cv_best_layer(layers)
        if layer is not None:
            chosen[strategy] = layer
    return chosen


def cv_best_layer(cv_by_layer: Mapping[int, Mapping[str, float]]) -> tuple[int | None, list[str]]:
    """The layer with the highest mean cv_auroc over the concepts run at every layer (ties to the lower layer),
    and those concepts; (None, []) when no concept was run at every layer. The one layer rule of PoolBench."""
    concepts = sorted(set.intersection(*(set(c) for c in cv_by_layer.values())))
    if not concepts:
        return None, concepts
    return max(sorted(cv_by_layer), key=lambda L: np.mean([cv_by_layer[L][c] for c in concepts])), concepts


def _summary(table: np.ndarray, strategies: list[str], alpha: float, significance: bool) -> dict:
    out: dict = {"n_units": int(table.shape[0]), "win_rate": mean_win_rate(table, strategies)}
    if not significance:
        return out
    complete = table[~np.isnan(table).any(axis=1)]
    if len(strategies) >= 3 and complete.shape[0] >= 2:
        out["friedman"] = friedman_nemenyi(complete, strategies, alpha=alpha)
    else:
        out["friedman"] = None
    return out


def across_cells(records: Iterable[dict], *, metric: str = "test_auroc", probe: str = RELIABILITY_PROBE,
                 alpha: float = 0.05, layers: dict[str, int] | None = None) -> dict:
    """Mean win rate and Friedman/Nemenyi with concepts as blocks, each strategy at one layer (`layers`).

    The layers of one concept share its passages, so (concept, layer) cells are not independent blocks:
    counting them as such shrinks the critical difference by about sqrt(number of layers). Each strategy is
    judged at `layers[strategy]`, by default its CV-chosen layer. `per_concept` describes one concept's
    layers (win rate only: no significance test on blocks that share passages).
    """
    records = [r for r in records if r.get("probe", probe) == probe]
    chosen = cv_chosen_layers(records, probe) if layers is None else dict(layers)
    at_layer = [r for r in records if chosen.get(r["strategy"]) == int(r["layer"])]
    _, strategies, table = score_matrix(at_layer, metric=metric, probe=probe, unit=("concept",))
    overall = _summary(table, strategies, alpha, significance=True)
    units, names, cells = score_matrix(records, metric=metric, probe=probe)
    per_concept = {}
    for concept in sorted({u[0] for u in units}):
        rows = [i for i, u in enumerate(units) if u[0] == concept]
        per_concept[concept] = {"unit": "layer", **_summary(cells[rows], names, alpha, significance=False)}
    selection = LAYER_SELECTION if layers is None else "each strategy at the layer the caller gave"
    return {"metric": metric, "probe": probe, "unit": "concept", "layer_selection": selection,
            "layers": {s: int(chosen[s]) for s in strategies}, "alpha": alpha,
            "strategies": strategies, **overall, "per_concept": per_concept, "version": RELIABILITY_VERSION}
