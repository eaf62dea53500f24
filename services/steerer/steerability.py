"""First-order steerability of a cell: how much adding its DiffMean vector raises the log-likelihood of the
concept's passages over their matched negatives, read off one gradient per passage (no generation).

The steering backends add delta = alpha * r_L * u at every position of layer L's output (vector.py: u the unit
DiffMean direction, r_L the layer's residual norm, alpha's unit). To first order the passage's log-likelihood
then moves by sum_t delta . g_t = alpha * r_L * u . G_L(x), with g_t = d log p(x) / d h_{L,t} and
G_L(x) = sum_t g_t over the passage's real tokens (attribution patching: Nanda 2023; AtP, Kramar et al. 2024).
The steerability of the cell is

    S = r_L * ( mean_{x in positives} u . G_L(x)  -  mean_{x in negatives} u . G_L(x) )

in nats of summed passage log-likelihood per unit of alpha: alpha * S is the predicted shift, at that alpha, of
the positives' mean log p minus the negatives'. Positives against negatives removes what any vector of that
length does to every text (the shared, concept-free part of the shift), so S > 0 means the vector makes concept
text more likely than its matched contrast. `exact_steerability` is the same quantity measured: the steered
minus the unsteered log p, positives against negatives, divided by alpha (same units), which S must track.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import SteeringError


def _classes(labels: np.ndarray, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    if y.shape != (n,):
        raise SteeringError(f"{what}: {n} passages but labels of shape {y.shape}")
    pos, neg = y == 1, y == 0
    if not pos.any() or not neg.any():
        raise SteeringError(f"{what}: needs positive and negative passages, got {int(pos.sum())} and "
                            f"{int(neg.sum())}")
    return pos, neg


def gradient_projections(direction: np.ndarray, gradient_sums: np.ndarray) -> np.ndarray:
    """[N] u . G(x) per passage, in float64: the first-order log p change per unit of delta along u."""
    u = np.asarray(direction, dtype=np.float64)
    G = np.asarray(gradient_sums, dtype=np.float64)
    if G.ndim != 2 or u.shape != (G.shape[1],):
        raise SteeringError(f"gradient sums {G.shape} and direction {u.shape} do not match")
    return G @ u


def first_order_steerability(direction: np.ndarray, residual_norm: float, gradient_sums: np.ndarray,
                             labels: np.ndarray) -> float:
    """S = r_L (mean over positives of u.G - mean over negatives of u.G), nats per unit alpha (module doc)."""
    proj = gradient_projections(direction, gradient_sums)
    pos, neg = _classes(labels, len(proj), "first-order steerability")
    return float(residual_norm) * float(proj[pos].mean() - proj[neg].mean())


def exact_steerability(logp_steered: np.ndarray, logp_base: np.ndarray, labels: np.ndarray, alpha: float) -> float:
    """The measured twin of S: (mean over positives of the log p shift - the same over negatives) / alpha."""
    if not alpha > 0:
        raise SteeringError(f"exact steerability needs alpha > 0, got {alpha}")
    shift = np.asarray(logp_steered, dtype=np.float64) - np.asarray(logp_base, dtype=np.float64)
    pos, neg = _classes(labels, len(shift), "exact steerability")
    return float(shift[pos].mean() - shift[neg].mean()) / float(alpha)


def residual_norm_from_sums(norm_sums: Sequence[float], norm_counts: Sequence[int]) -> float:
    """alpha's unit from per-passage sums: sum ||h_t|| / count over the passages' real tokens other than special
    tokens and each passage's first (what measures.mean_residual_norms computes over the same texts)."""
    count = int(np.sum(norm_counts))
    if count == 0:
        raise SteeringError("no real tokens to measure the residual norm on")
    return float(np.sum(np.asarray(norm_sums, dtype=np.float64))) / count
