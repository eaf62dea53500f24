"""D1 for learned aggregators: inside each CV fold, the pooled vectors of the aggregator fitted on exactly that
fold's training passages (poolbench.pooler.learned), so no scored passage's label shaped its own features.

The per-fold pooled table: a LearnedFoldTable holds, for every outer fit k (each D1 fold's training part, then
the whole train split), every passage's vector pooled by fit k. `LearnedFoldCell.design(fit_rows)` returns the
vectors of the fit whose training passages equal `fit_rows`; a fold plan that matches none (another seed, fold
count or a --flash subset than the pooling's) stops the probe with one line instead of reading a leaked fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from poolbench.pooler.learned import FITS_META, LearnedFoldView
from poolbench.pooler.pooled_table import PooledMatrix
from poolbench.prober.auroc import ProbeError


@dataclass
class LearnedFoldCell:
    """A learned strategy's cell: per-fit vectors [fits, N, d] and each fit's training passage ids."""

    strategy: str
    layer: int
    passage_ids: np.ndarray
    vectors: np.ndarray
    train_sets: list[frozenset[str]]

    def design(self, fit_rows: np.ndarray) -> np.ndarray:
        wanted = frozenset(str(pid) for pid in self.passage_ids[np.asarray(fit_rows)])
        for k, train in enumerate(self.train_sets):
            if train == wanted:
                return self.vectors[k]
        raise ProbeError(f"strategy {self.strategy!r} layer {self.layer}: no learned fit was trained on this "
                         f"fold's {len(wanted)} passages (pool with the probe's --seed and fold count; no --flash)")


def learned_fold_cell(cell: PooledMatrix, metadata: Mapping[str, str], view: LearnedFoldView | None, layer: int,
                      strategy: str) -> LearnedFoldCell | None:
    """The learned cell of (layer, strategy) in the order of `cell`, or None when the strategy is not learned."""
    if f"{strategy}{FITS_META}" not in metadata:
        return None
    if view is None:
        raise ProbeError(f"strategy {strategy!r} layer {layer}: learned, but its LearnedFoldTable was not given")
    vectors = view.cell(layer, strategy, cell.passage_ids).astype(np.float64)
    sets = [frozenset(fit["train"]) for fit in view.fits(strategy)]
    return LearnedFoldCell(strategy, layer, cell.passage_ids, vectors, sets)
