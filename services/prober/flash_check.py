"""`poolbench-driver flash-check`: does a flash-trained (train-fraction) ranking of strategies hold up?

Units are concepts, each strategy at one layer (the leaderboard's CV-chosen one): the layers of a concept
share its passages, so counting (concept, layer) cells as units would overstate how well the ranking is
resolved, as it did for Friedman's blocks. Each strategy's logistic probe is fitted on the full train split
and on each fraction, and scored by test AUROC on the same test passages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction

import numpy as np

from poolbench.prober.auroc import auroc
from poolbench.prober.flash import FlashError, flash_subset, rank_resolution
from poolbench.prober.power import ConceptCells

UNITS = "concept"


def flash_scores(concepts: Iterable[ConceptCells], strategies: Sequence[str], fractions: Sequence[Fraction],
                 layers: Mapping[str, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(full [concepts, k], flash [fractions, concepts, k]) test AUROCs, strategy s at layers[s]; one
    concept's vectors in memory at a time."""
    missing = [s for s in strategies if layers.get(s) is None]
    if missing:
        raise FlashError(f"flash-check: no chosen layer for {', '.join(missing)}")
    full_rows, flash_rows = [], []
    for cells in concepts:
        full_row, flash_row = [], [[] for _ in fractions]
        for name in strategies:
            layer = layers[name]
            cell = cells.matrix(layer, name)
            train_y, train_groups = cell.y[cell.split == "train"], cell.groups[cell.split == "train"]
            full = cells.heldout(layer, name)
            full_row.append(auroc(full.scores, full.test.y))
            for i, fraction in enumerate(fractions):
                rows = flash_subset(train_y, train_groups, fraction, seed=seed, concept=cells.concept)
                sub = cells.heldout(layer, name, rows)
                flash_row[i].append(auroc(sub.scores, sub.test.y))
        full_rows.append(full_row)
        flash_rows.append(flash_row)
    return np.array(full_rows), np.array(flash_rows).transpose(1, 0, 2)


def flash_check(concepts: Iterable[ConceptCells], strategies: Sequence[str], fractions: Sequence[Fraction], *,
                layers: Mapping[str, int], n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """Per fraction, the rank resolution and Kendall tau of the flash ranking against the full one, with
    concepts as the resampled units."""
    full, flash = flash_scores(concepts, strategies, fractions, layers, seed)
    rows = []
    for fraction, scores in zip(fractions, flash, strict=True):
        res = rank_resolution(full, scores, n_bootstrap=n_bootstrap, seed=seed)
        rows.append({"fraction": str(fraction), "rank_resolution": res.resolution, "kendall_tau": res.kendall_tau,
                     "rank_difference_interval": {s: [float(lo), float(hi)] for s, lo, hi in
                                                  zip(strategies, res.low, res.high, strict=True)}})
    return {"units": UNITS, "n_units": int(full.shape[0]), "layers": {s: int(layers[s]) for s in strategies},
            "metric": "test_auroc", "probe": "logistic", "n_bootstrap": n_bootstrap, "seed": seed,
            "strategies": list(strategies), "fractions": rows}
