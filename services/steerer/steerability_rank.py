"""Does the best probe steer best? Spearman's rank correlation between D1 and first-order steerability across
strategies, per concept, and its mean over concepts with a percentile bootstrap interval over concepts.

Ranks are taken within a concept because steerability's scale (nats per unit alpha) differs between concepts;
the mean of the per-concept correlations is the overall answer and the bootstrap resamples concepts, the unit
the benchmark generalises over. A concept with fewer than MIN_STRATEGIES strategies scored on both, or with
either measure constant across them, has no correlation and is counted, not dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.stats import bootstrap, spearmanr

MIN_STRATEGIES = 3
MIN_CONCEPTS_FOR_INTERVAL = 3
CONFIDENCE = 0.95
N_RESAMPLES = 9999


@dataclass(frozen=True)
class ConceptAgreement:
    concept: str
    rho: float | None  # None: fewer than MIN_STRATEGIES strategies, or a measure constant across them
    n_strategies: int


@dataclass(frozen=True)
class SteerabilityAgreement:
    """Spearman(D1, steerability) across strategies: per concept, and its mean over concepts with a percentile
    bootstrap interval over concepts (None with fewer than MIN_CONCEPTS_FOR_INTERVAL concepts)."""

    per_concept: tuple[ConceptAgreement, ...]
    mean_rho: float | None
    low: float | None
    high: float | None
    n_concepts: int  # concepts with a correlation
    method: str = "mean over concepts of Spearman(D1, first-order steerability) across strategies; " \
                  "95% percentile bootstrap over concepts"

    def to_record(self) -> dict:
        return {"mean_rho": self.mean_rho, "low": self.low, "high": self.high, "n_concepts": self.n_concepts,
                "method": self.method,
                "per_concept": [{"concept": c.concept, "rho": c.rho, "n_strategies": c.n_strategies}
                                for c in self.per_concept]}

    def sentence(self) -> str:
        """One sentence for the answer."""
        if self.mean_rho is None:
            return "Whether the best probe steers best is not measured: no concept has first-order steerability " \
                   f"on {MIN_STRATEGIES} or more strategies."
        interval = f" (95% CI {self.low:+.2f} to {self.high:+.2f} over concepts)" if self.low is not None else \
            " (too few concepts for an interval)"
        return (f"Does the best probe steer best? Spearman(D1, first-order steerability) across strategies is "
                f"{self.mean_rho:+.2f}{interval}, mean of {self.n_concepts} concepts.")


def concept_agreement(concept: str, d1: Mapping[str, float], steerability: Mapping[str, float | None]
                      ) -> ConceptAgreement:
    """Spearman over the strategies that have both a D1 and a (non-null) steerability."""
    both = sorted(s for s in d1 if steerability.get(s) is not None and np.isfinite(d1[s]))
    x = np.array([d1[s] for s in both], dtype=np.float64)
    y = np.array([steerability[s] for s in both], dtype=np.float64)
    if len(both) < MIN_STRATEGIES or np.ptp(x) == 0 or np.ptp(y) == 0 or not np.isfinite(y).all():
        return ConceptAgreement(concept, None, len(both))
    return ConceptAgreement(concept, float(spearmanr(x, y).statistic), len(both))


def steerability_agreement(d1: Mapping[str, Mapping[str, float]],
                           steerability: Mapping[str, Mapping[str, float | None]], *,
                           seed: int = 0) -> SteerabilityAgreement:
    """Per-concept Spearman(D1, steerability) for the concepts in both maps, and the mean with its interval."""
    per = tuple(concept_agreement(c, d1[c], steerability[c]) for c in sorted(d1) if c in steerability)
    rhos = np.array([c.rho for c in per if c.rho is not None], dtype=np.float64)
    if len(rhos) == 0:
        return SteerabilityAgreement(per, None, None, None, 0)
    low = high = None
    if len(rhos) >= MIN_CONCEPTS_FOR_INTERVAL and np.ptp(rhos) > 0:
        ci = bootstrap((rhos,), np.mean, confidence_level=CONFIDENCE, n_resamples=N_RESAMPLES,
                       method="percentile", random_state=np.random.default_rng(seed)).confidence_interval
        low, high = float(ci.low), float(ci.high)
    elif len(rhos) >= MIN_CONCEPTS_FOR_INTERVAL:
        low = high = float(rhos[0])
    return SteerabilityAgreement(per, float(rhos.mean()), low, high, len(rhos))
