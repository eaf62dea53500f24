"""The typed records of the answer's comparisons: which strategy was chosen as best (on training CV only), each other
strategy's one verdict against it with the tests behind it, and the confidence set for the best. The prober
computes them (poolbench.prober.verdicts); answer.json stores them; results only words them."""

from __future__ import annotations

from dataclasses import dataclass

WORSE = "worse than the best"
EQUIVALENT = "practically equivalent"
NOT_SEPARATED = "not separated"
BETTER = "better than the chosen best"  # the held-out test contradicts the CV choice (Wilcoxon-Holm, other ahead)
VERDICTS = (WORSE, EQUIVALENT, NOT_SEPARATED, BETTER)

CONFIRMED = "confirmed"  # the CV-chosen best also has the highest held-out mean
NOT_CONTRADICTED = "not contradicted"  # another strategy's held-out mean is higher, but not separably so
CONTRADICTED = "contradicted"  # another strategy is ahead on the held-out test by Wilcoxon-Holm


@dataclass(frozen=True)
class PairsBootstrap:
    """Best minus other, mean held-out AUROC over the run's concepts, resampling matched pairs within each concept:
    a statement about these concepts only, never about concepts at large."""

    difference: float
    low: float
    high: float
    p_value: float
    n_pairs: int
    n_bootstrap: int


@dataclass(frozen=True)
class NearTie:
    """A verdict at its test's boundary: the deciding value lies within `within` of the threshold, and on the other
    side the verdict would read `other_verdict`. Named so, never flipped silently from one machine to the next."""

    boundary: str  # which value meets which threshold, in words
    value: float
    threshold: float
    other_side: float  # the value the tolerance reaches, across the threshold
    within: str  # the tolerance, in words
    other_verdict: str


@dataclass(frozen=True)
class Comparison:
    """One strategy against the CV-chosen best on the concepts both were scored on.

    `mean_difference` is best minus this strategy (held-out AUROC, mean over concepts). The verdict: "practically
    equivalent" when the Bayesian signed-rank posterior puts at least `equivalence_posterior` on the ROPE; else
    "worse than the best" (or "better than the chosen best") when Wilcoxon's signed-rank p, Holm-adjusted over
    every comparison, is below alpha; else "not separated"."""

    strategy: str
    layer: int
    verdict: str
    test: str  # the test the verdict rests on, in words
    n_concepts: int
    mean_difference: float
    sd_difference: float | None
    wilcoxon_statistic: float | None
    wilcoxon_p: float | None
    holm_p: float | None
    p_best_better: float  # baycomp SignedRankTest: posterior probability mass regions, argmax frequency
    p_rope: float
    p_other_better: float
    concepts_to_separate: int | None  # from the observed spread; None where the mean difference is 0
    rank_low: int
    rank_high: int
    in_confidence_set: bool
    pairs: PairsBootstrap | None = None
    near_tie: NearTie | None = None  # the verdict sits within its test's tolerance of the threshold


@dataclass(frozen=True)
class BestChoice:
    """The run's best, chosen on the training CV alone (the highest mean out-of-fold AUROC over concepts at each
    strategy's CV-chosen layer), and whether the held-out test confirms it."""

    strategy: str
    layer: int
    cv_mean: float
    test_mean: float
    test_top: str  # the strategy with the highest held-out mean
    test_top_mean: float
    confirmation: str  # CONFIRMED, NOT_CONTRADICTED or CONTRADICTED
    n_concepts: int


@dataclass(frozen=True)
class StrategyVerdicts:
    """Everything the answer says about the strategies against each other, with the settings that produced it."""

    best: BestChoice
    comparisons: tuple[Comparison, ...]
    confidence_set: tuple[str, ...]  # strategies whose bootstrap rank interval over concepts reaches rank 1
    rope: float
    alpha: float
    equivalence_posterior: float
    power: float
    n_bootstrap: int
    level: float
    concepts_needed: int | None  # concepts that would separate every not-separated strategy (max over them)
    measure: str = "test_auroc"  # the per-concept held-out value compared: "test_auroc" or "tier_mixed_d1"
