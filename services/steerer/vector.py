"""DiffMean steering vectors and the alpha grid, as plain arrays (no model, no I/O).

alpha is in units of the layer's residual-stream norm without the sink: the added vector is
alpha * residual_norm * unit_direction, residual_norm the mean ||h_t|| over real tokens other than special
tokens and each text's first token (measures.mean_residual_norms), so alpha = 1 is as long as a typical word
token's hidden state there. With the sink in, one position set the unit: on SmolLM2-135M-Instruct at layer
16 (first token 22,700, other tokens ~190) the old unit was ~5x a word token's norm for 30-token texts, and
its old grid's first step (0.125) already gave a fluency ratio of 4.1.

DEFAULT_ALPHAS is geometric in steps of sqrt(2) from 0.05 to 0.8 of that norm, from a measured curve: the
S2_gradient vector at layer 12 of SmolLM2-135M-Instruct (imdb_sentiment, 20 chat prompts, 24 tokens) moved
classifier B from 0.46 at alpha 0 to 0.50, 0.51, 0.61, 0.64, 0.64 at 0.05, 0.1, 0.2, 0.4, 0.8 with fluency
ratios 0.98, 1.07, 1.87, 3.4, 16: no effect up to 0.1, broken from 0.4. The factor-2 grid had one point
(0.2) between them; sqrt(2) steps put 0.14, 0.2 and 0.28 there, and keep 0.57 and 0.8 to show the break.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .errors import SteeringError

DEFAULT_ALPHAS: tuple[float, ...] = (0.0, 0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.4, 0.57, 0.8)
# A DiffMean vector this small relative to the pooled vectors' own norm is numerically zero
# (P2_first on a causal LM pools the BOS state, identical for every passage).
RELATIVE_ZERO = 1e-6


@dataclass(frozen=True)
class SteeringVector:
    """A unit direction and its raw DiffMean norm; `direction` is None (with a reason) when there is none."""

    concept: str
    strategy: str
    layer: int
    direction: np.ndarray | None
    raw_norm: float
    residual_norm: float | None = None
    null_reason: str | None = None

    @property
    def is_null(self) -> bool:
        return self.direction is None

    def delta(self, alpha: float) -> np.ndarray:
        """The vector added to the residual stream at this alpha."""
        if self.direction is None or self.residual_norm is None:
            raise SteeringError(f"steering vector {self.concept}/{self.strategy}/L{self.layer} is null: "
                                f"{self.null_reason or 'no residual norm measured'}")
        return (alpha * self.residual_norm * self.direction).astype(np.float32)

    def with_residual_norm(self, residual_norm: float) -> SteeringVector:
        return SteeringVector(self.concept, self.strategy, self.layer, self.direction, self.raw_norm,
                              float(residual_norm), self.null_reason)

    def to_record(self) -> dict:
        return {"concept": self.concept, "strategy": self.strategy, "layer": self.layer,
                "vector_norm": self.raw_norm, "residual_norm": self.residual_norm,
                "vector_null_reason": self.null_reason}


def diffmean_vector(X: np.ndarray, y: np.ndarray, *, concept: str, strategy: str, layer: int) -> SteeringVector:
    """Mean of positive pooled vectors minus mean of negatives; null, never NaN, when it vanishes."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise SteeringError(f"diffmean {concept}/{strategy}: X {X.shape} and y {y.shape} do not match")
    pos, neg = X[y == 1], X[y == 0]

    def null(reason: str, norm: float = 0.0) -> SteeringVector:
        return SteeringVector(concept, strategy, layer, None, norm, None, reason)

    if len(pos) == 0 or len(neg) == 0:
        return null(f"train split has {len(pos)} positive and {len(neg)} negative vectors")
    if not np.all(np.isfinite(X)):
        return null("pooled vectors contain non-finite values")
    diff = pos.mean(axis=0) - neg.mean(axis=0)
    norm = float(np.linalg.norm(diff))
    scale = float(np.mean(np.linalg.norm(X, axis=1)))
    if norm <= RELATIVE_ZERO * max(scale, 1e-30):
        return null(f"zero-norm DiffMean vector (|v| = {norm:.3g}, pooled vectors ~{scale:.3g}): "
                    "the strategy pools the same vector for both classes", norm)
    return SteeringVector(concept, strategy, layer, (diff / norm).astype(np.float32), norm)


def validate_alphas(alphas: Iterable[float] | None) -> tuple[float, ...]:
    """Sorted unique non-negative finite alphas; 0 is added when missing, since D2 measures against it."""
    grid = list(DEFAULT_ALPHAS if alphas is None else alphas)
    if not grid:
        raise SteeringError("alpha grid is empty; give at least one alpha, e.g. 0,0.25,0.5,1")
    bad = [a for a in grid if not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0]
    if bad:
        raise SteeringError(f"alpha grid {grid} has negative or non-finite values {bad}; alphas must be >= 0")
    out = sorted({float(a) for a in grid} | {0.0})
    if len(out) < 2:
        raise SteeringError("alpha grid needs at least one alpha > 0 besides the unsteered alpha = 0")
    return tuple(out)


def cosine(u: np.ndarray | None, v: np.ndarray | None) -> float | None:
    """Cosine of two directions; None when either is missing or zero."""
    if u is None or v is None:
        return None
    nu, nv = float(np.linalg.norm(u)), float(np.linalg.norm(v))
    if nu == 0.0 or nv == 0.0:
        return None
    return float(np.dot(np.asarray(u, np.float64), np.asarray(v, np.float64)) / (nu * nv))
