"""First-order steerability of one (concept, strategy, layer) cell from what the pooling stored: the DiffMean
direction of the train split (as D2 steers with it), alpha's unit from the train split's residual norms (as D2
measures it), and the gradient sums of the held-out test split, positives against negatives (steerability.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from poolbench.pooler.gradient_sums import gradient_arrays
from poolbench.pooler.pooled_table import PooledTableView

from .steerability import first_order_steerability, residual_norm_from_sums
from .vector import diffmean_vector


@dataclass(frozen=True)
class SteerabilityCell:
    """One cell's first-order steerability S (nats of passage log-likelihood per unit alpha, positives minus
    negatives on the test split); None with a reason where there is no vector or no gradient."""

    concept: str
    strategy: str
    layer: int
    steerability: float | None
    residual_norm: float | None
    n_positive: int
    n_negative: int
    null_reason: str | None = None

    def to_record(self) -> dict:
        return {"concept": self.concept, "strategy": self.strategy, "layer": self.layer,
                "steerability": self.steerability, "residual_norm": self.residual_norm,
                "n_positive": self.n_positive, "n_negative": self.n_negative, "null_reason": self.null_reason}


def stored_residual_norm(gradients: pa.Table, train_ids: Sequence) -> float:
    """alpha's unit at the gradient table's layer from the norm sums S2's extraction stored for the train passages:
    the one r_L that first-order S and D2's steering vector both use (tests/test_gradient_sums.py holds it to
    measures.mean_residual_norms on the same texts)."""
    _, norm_sums, norm_counts = gradient_arrays(gradients, [str(p) for p in train_ids])
    return residual_norm_from_sums(norm_sums, norm_counts)


def cell_steerability(view: PooledTableView, gradients: pa.Table | None, concept: str, strategy: str,
                      layer: int) -> SteerabilityCell:
    """S for the cell from its layer's pooled shard (as a view) and that shard's gradient table."""
    if (layer, strategy) not in set(view.cells):
        return SteerabilityCell(concept, strategy, layer, None, None, 0, 0,
                                "no pooled vector in the shard (a supervised strategy steers with none)")
    cell = view.matrix(layer, strategy)
    test = cell.subset("test")
    n_pos, n_neg = int((test.y == 1).sum()), int((test.y == 0).sum())

    def null(reason: str, residual: float | None = None) -> SteerabilityCell:
        return SteerabilityCell(concept, strategy, layer, None, residual, n_pos, n_neg, reason)

    if gradients is None:
        return null("no gradient sums stored at this layer (pooled without S2_gradient)")
    train = cell.subset("train")
    vector = diffmean_vector(train.X, train.y, concept=concept, strategy=strategy, layer=layer)
    residual = stored_residual_norm(gradients, train.passage_ids)
    if vector.direction is None:
        return null(f"steering vector is null: {vector.null_reason}", residual)
    if n_pos == 0 or n_neg == 0:
        return null(f"test split has {n_pos} positive and {n_neg} negative passages", residual)
    G, _, _ = gradient_arrays(gradients, [str(p) for p in test.passage_ids])
    value = first_order_steerability(vector.direction, residual, G, test.y)
    return SteerabilityCell(concept, strategy, layer, value if np.isfinite(value) else None, residual, n_pos,
                            n_neg, None if np.isfinite(value) else "non-finite gradient sums")
