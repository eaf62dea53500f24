"""The reliability statistics around D1: per cell (seeds, selectivity, MDL) and across cells (win rate,
Friedman + Nemenyi). Arrays and records in, flat JSON-able dicts out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from poolbench.prober.auroc import ProbeError
from poolbench.prober.d1 import check_split
from poolbench.prober.fast_folds import check_folds
from poolbench.prober.mdl import online_codelength
from poolbench.prober.newton_logistic import NewtonLogisticProbe, newton_logistic
from poolbench.prober.seed_spread import seed_spread
from poolbench.prober.selectivity import selectivity
from poolbench.prober.significance import friedman_nemenyi
from poolbench.prober.win_rate import mean_win_rate

RELIABILITY_VERSION = 1
RELIABILITY_PROBE = "logistic"
_BLAS = ThreadpoolController()


def cell_reliability(X_train: np.ndarray, y_train: np.ndarray, groups_train: np.ndarray,
                     ids_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray, groups_test: np.ndarray,
                     *, seed: int,
                     n_seeds: int = 5, n_folds: int = 5) -> dict:
    """Seed spread of CV AUROC, selectivity and MDL compression of D1's logistic probe on one cell.

    The test split is only validated here (the statistics live on train, so they never touch D1's
    held-out judgement). Every fit is warm-started from the all-train fit.
    """
    X_train, y_train, groups_train = check_split("train", X_train, y_train, groups_train)
    X_test, y_test, groups_test = check_split("test", X_test, y_test, groups_test)
    if X_train.shape[1] != X_test.shape[1]:
        raise ProbeError(f"train has {X_train.shape[1]} features but test has {X_test.shape[1]}")
    check_folds(y_train, groups_train, n_folds)
    with _BLAS.limit(limits=1, user_api="blas"):
        full = NewtonLogisticProbe().fit(X_train, y_train)
        init = (full.coef_, full.intercept_)
        spread = seed_spread(X_train, y_train, groups_train, seed=seed, n_seeds=n_seeds, n_folds=n_folds,
                             init=init)
        sel = selectivity(X_train, y_train, groups_train, ids_train, seed=seed, n_folds=n_folds,
                          true_score=float(spread.cv_aurocs[0]))
        code = online_codelength(X_train, y_train, groups_train, seed=seed, probe=newton_logistic)
    return {
        "reliability_probe": RELIABILITY_PROBE,
        "seed_cv_aurocs": [float(v) for v in spread.cv_aurocs],
        "seed_mean": spread.mean,
        "seed_std": spread.std,
        "selectivity": sel.selectivity,
        "control_cv_auroc": sel.control_score,
        "mdl_compression": code.compression,
        "mdl_online_bits": code.online_bits,
        "mdl_uniform_bits": code.uniform_bits,
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


def _summary(table: np.ndarray, strategies: list[str], alpha: float) -> dict:
    out: dict = {"n_units": int(table.shape[0]), "win_rate": mean_win_rate(table, strategies)}
    complete = table[~np.isnan(table).any(axis=1)]
    if len(strategies) >= 3 and complete.shape[0] >= 2:
        out["friedman"] = friedman_nemenyi(complete, strategies, alpha=alpha)
    else:
        out["friedman"] = None
    return out


def across_cells(records: Iterable[dict], *, metric: str = "test_auroc", probe: str = RELIABILITY_PROBE,
                 alpha: float = 0.05) -> dict:
    """Mean win rate and Friedman/Nemenyi over all (concept, layer) cells, and per concept over its layers.

    The comparison unit is a (concept, layer) cell: every strategy is judged on the same passages at the
    same layer, so a head-to-head is like for like.
    """
    records = [r for r in records if r.get("probe", probe) == probe]
    units, strategies, table = score_matrix(records, metric=metric, probe=probe)
    overall = _summary(table, strategies, alpha)
    per_concept = {}
    for concept in sorted({u[0] for u in units}):
        rows = [i for i, u in enumerate(units) if u[0] == concept]
        per_concept[concept] = _summary(table[rows], strategies, alpha)
    return {"metric": metric, "probe": probe, "unit": "concept x layer", "alpha": alpha,
            "strategies": strategies, **overall, "per_concept": per_concept, "version": RELIABILITY_VERSION}
