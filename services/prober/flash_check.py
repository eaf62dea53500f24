"""`poolbench-driver flash-check`: does a flash-trained (train-fraction) ranking of strategies hold up?

Units are (concept, layer) cells of a finished run; each strategy's logistic probe is fitted on the full
train split and on each fraction, and scored by test AUROC on the same test passages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fractions import Fraction

import numpy as np
import pyarrow as pa

from poolbench.pooler.pooled_table import PooledMatrix, PooledTableView
from poolbench.prober.auroc import auroc
from poolbench.prober.flash import flash_subset, rank_resolution
from poolbench.prober.power import heldout_predictions


def flash_scores(pooled: Iterable[tuple[str, pa.Table]], strategies: Sequence[str], fractions: Sequence[Fraction],
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(full [units, k], flash [fractions, units, k]) test AUROCs; one concept's table in memory at a time."""
    full_rows, flash_rows = [], []
    for concept, table in pooled:
        view = PooledTableView(table)
        for layer in sorted({L for L, _ in view.cells}):
            full_row, flash_row = [], [[] for _ in fractions]
            for name in strategies:
                cell = view.matrix(layer, name)
                train, test = cell.subset("train"), cell.subset("test")
                full_row.append(auroc(heldout_predictions(train, test)[1], test.y))
                for i, fraction in enumerate(fractions):
                    rows = flash_subset(train.y, train.groups, fraction, seed=seed, concept=concept)
                    sub = PooledMatrix(train.passage_ids[rows], train.X[rows], train.y[rows],
                                       train.groups[rows], train.split[rows], train.fallback[rows])
                    flash_row[i].append(auroc(heldout_predictions(sub, test)[1], test.y))
            full_rows.append(full_row)
            flash_rows.append(flash_row)
    return np.array(full_rows), np.array(flash_rows).transpose(1, 0, 2)


def flash_check(pooled: Iterable[tuple[str, pa.Table]], strategies: Sequence[str], fractions: Sequence[Fraction],
                *, n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Per fraction, the rank resolution and Kendall tau of the flash ranking against the full one."""
    full, flash = flash_scores(pooled, strategies, fractions, seed)
    rows = []
    for fraction, scores in zip(fractions, flash, strict=True):
        res = rank_resolution(full, scores, n_bootstrap=n_bootstrap, seed=seed)
        rows.append({"fraction": str(fraction), "rank_resolution": res.resolution, "kendall_tau": res.kendall_tau,
                     "rank_difference_interval": {s: [float(lo), float(hi)] for s, lo, hi in
                                                  zip(strategies, res.low, res.high, strict=True)}})
    return {"units": "concept x layer", "metric": "test_auroc", "probe": "logistic", "n_bootstrap": n_bootstrap,
            "seed": seed, "strategies": list(strategies), "fractions": rows}
