"""May first-order steerability stand in for D2? Its per-concept rank agreement across strategies with the exact
log-likelihood shift at the same alpha (is the linearisation good?) and with generation-based D2 (does a
likelihood shift become concept text a scorer sees?), against pass criteria fixed before any run.

Criteria (stated here, before looking): the first-order measure tracks the exact shift when the mean over concepts
of Spearman(S, exact) is at least EXACT_MIN_RHO; it tracks D2 when the mean of Spearman(S, D2 Delta(alpha*)) is
at least D2_MIN_RHO and its bootstrap interval's lower end is above 0. It may stand in for D2 only when both
hold; otherwise the answer says it may not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.stats import bootstrap, rankdata

from .steerability_rank import CONFIDENCE, MIN_STRATEGIES, SteerabilityAgreement, steerability_agreement

EXACT_MIN_RHO = 0.8
D2_MIN_RHO = 0.5


@dataclass(frozen=True)
class ValidationCell:
    """One cell's three measures: first-order S and the exact shift per unit alpha (nats per unit alpha), and
    D2 (Delta(alpha*) of classifier B's score) with the score shift at the validation alpha (report half)."""

    concept: str
    strategy: str
    layer: int
    first_order: float | None
    exact: float | None
    d2_delta: float | None = None
    d2_shift_at_alpha: float | None = None
    null_reason: str | None = None

    def to_record(self) -> dict:
        return {"concept": self.concept, "strategy": self.strategy, "layer": self.layer,
                "first_order": self.first_order, "exact": self.exact, "d2_delta": self.d2_delta,
                "d2_shift_at_alpha": self.d2_shift_at_alpha, "null_reason": self.null_reason}


@dataclass(frozen=True)
class SteerabilityVerdict:
    alpha: float
    exact: SteerabilityAgreement  # Spearman(S, exact shift) per concept
    d2: SteerabilityAgreement | None  # Spearman(S, D2 Delta(alpha*)); None when D2 did not run
    d2_at_alpha: SteerabilityAgreement | None  # Spearman(S, score shift at alpha), for the record
    tracks_exact: bool
    tracks_d2: bool | None
    n_cells: int
    # per concept, Spearman's 95% percentile bootstrap interval over strategies (pairs resampled), per measure
    concept_intervals: dict[str, dict[str, tuple[float, float] | None]] = field(default_factory=dict)

    @property
    def stands_in(self) -> bool:
        return self.tracks_exact and bool(self.tracks_d2)

    def to_record(self) -> dict:
        return {"alpha": self.alpha, "exact_min_rho": EXACT_MIN_RHO, "d2_min_rho": D2_MIN_RHO,
                "exact": self.exact.to_record(), "d2": None if self.d2 is None else self.d2.to_record(),
                "d2_at_alpha": None if self.d2_at_alpha is None else self.d2_at_alpha.to_record(),
                "tracks_exact": self.tracks_exact, "tracks_d2": self.tracks_d2, "stands_in": self.stands_in,
                "n_cells": self.n_cells, "sentence": self.sentence(),
                "concept_intervals": {m: {c: None if ci is None else list(ci) for c, ci in by.items()}
                                      for m, by in self.concept_intervals.items()}}

    def sentence(self) -> str:
        exact = _rho_text(self.exact)
        if self.d2 is None:
            return (f"First-order steerability against the exact shift at alpha = {self.alpha:g}: {exact} "
                    f"({'passes' if self.tracks_exact else 'fails'} >= {EXACT_MIN_RHO}); D2 did not run, so "
                    "it is not validated as a stand-in for D2.")
        verdict = "may stand in for D2" if self.stands_in else "may NOT stand in for D2"
        return (f"First-order steerability {verdict}: Spearman with the exact shift at alpha = {self.alpha:g} "
                f"{exact} (criterion >= {EXACT_MIN_RHO}), with D2 {_rho_text(self.d2)} (criterion >= "
                f"{D2_MIN_RHO}, interval above 0), mean over concepts.")


def _rho_text(agreement: SteerabilityAgreement) -> str:
    if agreement.mean_rho is None:
        return "not computable"
    interval = "" if agreement.low is None else f" [{agreement.low:+.2f}, {agreement.high:+.2f}]"
    return f"{agreement.mean_rho:+.2f}{interval} over {agreement.n_concepts} concepts"


def _by_concept(cells: Sequence[ValidationCell], field: str) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for cell in cells:
        out.setdefault(cell.concept, {})[cell.strategy] = getattr(cell, field)
    return out


def concept_rho_interval(first: dict[str, float | None], other: dict[str, float | None], *, seed: int = 0,
                         n_resamples: int = 2000) -> tuple[float, float] | None:
    """Spearman(first, other) over the strategies both score: a percentile bootstrap interval, strategies
    resampled with their pair of values (None below MIN_STRATEGIES strategies or when either is constant; a
    resample that makes one constant counts as 0)."""
    both = sorted(s for s, v in first.items() if v is not None and other.get(s) is not None)
    x = np.array([first[s] for s in both], dtype=np.float64)
    y = np.array([other[s] for s in both], dtype=np.float64)
    if len(both) < MIN_STRATEGIES or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None

    def rho(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        ra, rb = rankdata(a, axis=axis), rankdata(b, axis=axis)  # Spearman: Pearson of the ranks, per resample
        ra, rb = ra - ra.mean(axis=axis, keepdims=True), rb - rb.mean(axis=axis, keepdims=True)
        den = np.sqrt((ra * ra).sum(axis=axis) * (rb * rb).sum(axis=axis))
        return np.divide((ra * rb).sum(axis=axis), den, out=np.zeros_like(den), where=den > 0)

    ci = bootstrap((x, y), rho, paired=True, vectorized=True, confidence_level=CONFIDENCE, method="percentile",
                   n_resamples=n_resamples, random_state=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


def steerability_verdict(cells: Sequence[ValidationCell], alpha: float, *, seed: int = 0) -> SteerabilityVerdict:
    """The agreements and the pass criteria (module doc) over the validation's cells."""
    first = {c: {s: v for s, v in by.items() if v is not None}
             for c, by in _by_concept(cells, "first_order").items()}
    exact = steerability_agreement(first, _by_concept(cells, "exact"), seed=seed)
    ran_d2 = any(c.d2_delta is not None for c in cells)
    d2 = steerability_agreement(first, _by_concept(cells, "d2_delta"), seed=seed) if ran_d2 else None
    at_alpha = steerability_agreement(first, _by_concept(cells, "d2_shift_at_alpha"), seed=seed) if ran_d2 else None
    tracks_exact = exact.mean_rho is not None and exact.mean_rho >= EXACT_MIN_RHO
    tracks_d2 = None if d2 is None else (d2.mean_rho is not None and d2.mean_rho >= D2_MIN_RHO
                                         and d2.low is not None and d2.low > 0)
    measures = {"exact": "exact"} | ({"d2": "d2_delta", "d2_at_alpha": "d2_shift_at_alpha"} if ran_d2 else {})
    intervals = {name: {c: concept_rho_interval(first.get(c, {}), by_c, seed=seed)
                        for c, by_c in sorted(_by_concept(cells, attr).items())}
                 for name, attr in measures.items()}
    return SteerabilityVerdict(alpha, exact, d2, at_alpha, tracks_exact, tracks_d2, len(cells), intervals)
