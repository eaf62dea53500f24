"""D1's DiffMean probe (the reference's C1) for every fold of a cell and its all-train fit at once, as tensor work.

DiffMeanProbe fits one fold at a time in numpy on the host: on a GPU that is ~28% of a batched D1 cell (its folds,
scikit-learn's input checks, a [1,400 × 4,096] float64 matrix walked per fold; bench/measured/h200_warm), while
the same numbers are two GEMMs on the device where the features already are. Each fit is DiffMeanProbe's:
direction = mean(pos) − mean(neg) over the fit's rows, score = x · direction − ½ (mean(pos) + mean(neg)) · direction,
equal rows scored once (distinct_rows). The class means are weighted sums (x_i / count summed) where numpy sums
then divides: float64 round-off of the same terms, so scores agree with DiffMeanProbe's within a few eps of
|x|·|direction| (tests/test_diffmean_batched.py) and AUROCs wherever no two distinct scores lie that close."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from poolbench.prober.distinct_rows import score_distinct_rows


def diffmean_scores(X: torch.Tensor, fit_rows: Sequence[np.ndarray], y: np.ndarray,
                    X_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([F, rows of X] every fit's decision scores of every row of X, [F, rows of X_test] the same of X_test) for
    fits f on rows fit_rows[f] of X with 0/1 labels y (one label a row of X)."""
    F, n = len(fit_rows), X.shape[0]
    weights = np.zeros((2 * F, n))
    for f, rows in enumerate(fit_rows):
        pos = rows[y[rows] == 1]
        neg = rows[y[rows] == 0]
        weights[f, pos] = 1.0 / pos.size
        weights[F + f, neg] = 1.0 / neg.size
    means = torch.as_tensor(weights, dtype=X.dtype, device=X.device) @ X  # [2F, d]: each fit's class means
    mean_pos, mean_neg = means[:F], means[F:]
    direction = mean_pos - mean_neg
    threshold = 0.5 * ((mean_pos + mean_neg) * direction).sum(dim=1)

    def score(rows: torch.Tensor) -> torch.Tensor:
        return (rows @ direction.T - threshold).T

    return score_distinct_rows(score, X), score_distinct_rows(score, X_test)
