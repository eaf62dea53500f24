"""Which strategies does the data separate from the best? The best is chosen on training CV only; every other strategy
then gets one verdict against it from tests that generalise over concepts: Wilcoxon's signed-rank test with Holm's
step-down (scipy; Holm as statsmodels computes it) and the Bayesian signed-rank test with a region of practical
equivalence (baycomp's samples, from its vectorised twin signed_rank_posterior; Benavoli et al., JMLR 2017). Beside
them: a paired bootstrap over matched pairs (on these concepts only) and a confidence set for the best from bootstrap
rank intervals over concepts. Arrays in, records out; no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise

import numpy as np
from scipy.stats import nct, norm, rankdata, wilcoxon
from scipy.stats import t as t_dist

from poolbench.prober.auroc import ProbeError, auroc_batch, group_bootstrap_weights
from poolbench.prober.passage_scores import HeldOutCell
from poolbench.prober.signed_rank_posterior import signed_rank_probs
from poolbench.records.d1 import choose_on_cv
from poolbench.records.verdicts import (
    BETTER,
    CONFIRMED,
    CONTRADICTED,
    EQUIVALENT,
    NOT_CONTRADICTED,
    NOT_SEPARATED,
    WORSE,
    BestChoice,
    Comparison,
    NearTie,
    PairsBootstrap,
    StrategyVerdicts,
)

DEFAULT_ROPE = 0.01  # AUROC: a difference under one point in a hundred is no practical difference
ALPHA = 0.05
EQUIVALENCE_POSTERIOR = 0.95
TARGET_POWER = 0.8
POSTERIOR_SAMPLES = 20_000
MC_ERRORS = 3  # a posterior share within this many Monte Carlo standard errors of its threshold is a near-tie
MAX_CONCEPTS = 100_000  # beyond this the answer says "more than" (the power equation has no useful solution)


def holm_adjusted(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values, exactly as statsmodels' `multipletests(p, method="holm")[1]` (a test
    holds them equal): sorted p times (m, m - 1, ..., 1), running maximum, capped at 1. Written out because
    multipletests calls gc.collect() on every Holm call, ~0.3 s in a driver holding torch and Ray: 17 s of a
    three-concept run went to the two near-tie checks per strategy."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p)
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(np.maximum.accumulate(p[order] * np.arange(p.size, 0, -1)), 1.0)
    return adjusted


def wilcoxon_p(differences: np.ndarray) -> tuple[float | None, float | None]:
    """(statistic, two-sided p) of Wilcoxon's signed-rank test; (None, 1.0) where every difference is 0."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0 or not np.any(d != 0.0):
        return None, 1.0
    result = wilcoxon(d, zero_method="wilcox", alternative="two-sided")
    return float(result.statistic), float(result.pvalue)  # pyright: ignore[reportAttributeAccessIssue]


def one_rank_swap(differences: np.ndarray) -> list[np.ndarray]:
    """The differences with Wilcoxon's W+ one higher and one lower, where one swap can do it: two neighbours in
    |d| of opposite sign trade magnitudes, or the smallest crosses 0. Two differences trade places by round-off only
    when they are that close, so a verdict that changes here is a near-tie."""
    d = np.asarray(differences, dtype=np.float64)
    nz = [int(i) for i in np.argsort(np.abs(d), kind="stable") if d[i] != 0.0]
    out = []
    for sign in (1.0, -1.0):  # W+ up: a positive below a negative; W+ down: a negative below a positive
        if nz and np.sign(d[nz[0]]) == -sign:
            moved = d.copy()
            moved[nz[0]] = -moved[nz[0]]
            out.append(moved)
            continue
        for lo, hi in pairwise(nz):
            if np.sign(d[lo]) == sign and np.sign(d[hi]) == -sign and abs(d[lo]) != abs(d[hi]):
                moved = d.copy()
                moved[lo], moved[hi] = sign * abs(d[hi]), -sign * abs(d[lo])
                out.append(moved)
                break
    return out


def rope_near_tie(p_rope: float, threshold: float, nsamples: int) -> tuple[float, str] | None:
    """(the share across the threshold, the tolerance in words) when P(ROPE) lies within MC_ERRORS Monte Carlo
    standard errors of `threshold` (a share of `nsamples` posterior samples at the threshold's rate), else None."""
    se = math.sqrt(threshold * (1.0 - threshold) / nsamples)
    if abs(p_rope - threshold) > MC_ERRORS * se:
        return None
    other = threshold - MC_ERRORS * se if p_rope >= threshold else threshold + MC_ERRORS * se
    return other, f"{MC_ERRORS} Monte Carlo standard errors of {nsamples} posterior samples"


def holm_near_tie(diffs: Mapping[str, np.ndarray], strategy: str, raw: Sequence[float], others: Sequence[str],
                  alpha: float) -> float | None:
    """The strategy's Holm p after one rank swap in its differences when that crosses `alpha`, else None."""
    i = list(others).index(strategy)
    now = holm_adjusted(raw)[i] < alpha
    for moved in one_rank_swap(diffs[strategy]):
        p = list(raw)
        p[i] = wilcoxon_p(moved)[1] or 1.0
        holm = float(holm_adjusted(p)[i])
        if (holm < alpha) != now:
            return holm
    return None


def _near_tie(verdict: str, mean_d: float, p_rope: float, holm_p: float, swapped_holm: float | None, *,
              alpha: float, equivalence_posterior: float, nsamples: int) -> NearTie | None:
    """The boundary the verdict sits at, if any: the ROPE posterior's first (it decides first), then Holm's p."""
    rope = rope_near_tie(p_rope, equivalence_posterior, nsamples)
    if rope is not None:
        other_verdict = (_verdict(0.0, holm_p, mean_d, alpha, equivalence_posterior)[0] if verdict == EQUIVALENT
                         else EQUIVALENT)
        return NearTie("P(ROPE) at the equivalence posterior", p_rope, equivalence_posterior, rope[0], rope[1],
                       other_verdict)
    if verdict != EQUIVALENT and swapped_holm is not None:
        other_verdict = NOT_SEPARATED if verdict != NOT_SEPARATED else (WORSE if mean_d > 0 else BETTER)
        return NearTie("Wilcoxon-Holm p at α", holm_p, alpha, swapped_holm,
                       "one swap of two neighbouring signed ranks", other_verdict)
    return None


def bayesian_signed_rank(best: np.ndarray, other: np.ndarray, rope: float, *, nsamples: int = POSTERIOR_SAMPLES,
                         seed: int = 0) -> tuple[float, float, float]:
    """(P(best better), P(equivalent within ±rope), P(other better)) from baycomp's Bayesian signed-rank test
    (its samples, bit for bit, from signed_rank_posterior): the share of posterior samples in which each region
    holds the most mass."""
    p_other, p_rope, p_best = signed_rank_probs(other, best, rope, nsamples=nsamples, seed=seed)
    return p_best, p_rope, p_other


def concepts_to_separate(differences: np.ndarray, alpha: float, power: float = TARGET_POWER) -> int | None:
    """The fewest concepts with which a two-sided paired t-test at `alpha` reaches `power` against the observed
    mean difference, taking the observed spread across concepts as the truth (the power of the
    noncentral t, bisected over whole counts); None where the mean difference is 0 (no number would do)."""
    d = np.asarray(differences, dtype=np.float64)
    mean = float(abs(d.mean()))
    if d.size < 2 or mean == 0.0:
        return None
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        return 2
    effect = mean / sd
    guess = ((norm.ppf(1 - alpha / 2) + norm.ppf(power)) / effect) ** 2  # the normal approximation, a lower bound
    def enough(n: int) -> bool:  # scipy's noncentral t (statsmodels' TTestPower returns NaN at large noncentrality)
        crit, nc = float(t_dist.ppf(1 - alpha / 2, n - 1)), effect * math.sqrt(n)
        upper, lower = float(nct.sf(crit, n - 1, nc)), float(nct.cdf(-crit, n - 1, nc))
        # scipy's nct gives NaN far in a tail (the lower one at 60 concepts and effect 0.84): that tail is ~0 there,
        # and a NaN read as "not enough" sent the search to MAX_CONCEPTS for a difference 17 concepts had separated
        upper = upper if math.isfinite(upper) else float(nc > crit)
        lower = lower if math.isfinite(lower) else 0.0
        return upper + lower >= power

    low, high = 2, int(min(MAX_CONCEPTS, 2 * guess + 50))
    if not enough(high):
        return MAX_CONCEPTS
    while low < high:  # the power rises with n: bisect for the first count that reaches it
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid + 1, high)
    return low


def rank_intervals(scores: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) rank of each strategy [k] (1 = best) over bootstrap resamples of concepts (rows of scores
    [n, k]): percentile interval of the rank of its mean; ties share the better rank."""
    scores = np.asarray(scores, dtype=np.float64)
    n = scores.shape[0]
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(n_bootstrap, n))
    means = scores[draws].mean(axis=1)  # [B, k]
    ranks = rankdata(-means, axis=1, method="min")
    tail = (1.0 - level) / 2.0
    low = np.floor(np.quantile(ranks, tail, axis=0, method="lower")).astype(int)
    high = np.ceil(np.quantile(ranks, 1.0 - tail, axis=0, method="higher")).astype(int)
    return low, high


def concept_resamples(cells: Sequence[HeldOutCell], *, n_bootstrap: int = 1000,
                      seed: int = 0) -> list[tuple[float, np.ndarray]]:
    """Per concept (k-th cell), the strategy's held-out AUROC and its AUROCs under that concept's pair resamples
    (seed + k): what pairs_bootstrap takes from each side, computed once for the best, which meets every other."""
    out = []
    for k, cell in enumerate(cells):
        pos = cell.labels.astype(bool)
        weights = group_bootstrap_weights(cell.pair_ids, pos, n_bootstrap, seed + k)
        out.append((float(auroc_batch(cell.scores, pos, np.ones((1, pos.size)))[0]),
                    auroc_batch(cell.scores, pos, weights)))
    return out


def pairs_bootstrap(best: Sequence[HeldOutCell], other: Sequence[HeldOutCell], *, n_bootstrap: int = 1000,
                    seed: int = 0, level: float = 0.95,
                    best_resamples: Sequence[tuple[float, np.ndarray]] | None = None) -> PairsBootstrap:
    """Mean over concepts of AUROC(best) - AUROC(other) on the same held-out passages, both scored under the same
    resamples of matched pairs in every concept; p is twice the smaller tail share at 0 (at least 1/B).
    `best_resamples`: concept_resamples(best) with the same count and seed, where the caller has it."""
    if len(best) != len(other) or not best:
        raise ProbeError(f"pairs bootstrap: {len(best)} concepts for the best but {len(other)} for the other")
    for a, b in zip(best, other, strict=True):
        if not np.array_equal(a.passage_ids, b.passage_ids):
            raise ProbeError("pairs bootstrap: the two strategies were not scored on the same held-out passages")
    if best_resamples is None:
        best_resamples = concept_resamples(best, n_bootstrap=n_bootstrap, seed=seed)
    diffs = np.zeros(n_bootstrap)
    point, n_pairs = 0.0, 0
    for (a_point, a_resampled), (b_point, b_resampled), cell in zip(
            best_resamples, concept_resamples(other, n_bootstrap=n_bootstrap, seed=seed), best, strict=True):
        point += a_point - b_point
        diffs += a_resampled - b_resampled
        n_pairs += int(np.unique(cell.pair_ids).size)
    diffs /= len(best)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    p = min(1.0, 2.0 * max(min(float(np.mean(diffs <= 0)), float(np.mean(diffs >= 0))), 1.0 / n_bootstrap))
    return PairsBootstrap(point / len(best), float(low), float(high), p, n_pairs, n_bootstrap)


def _verdict(p_rope: float, holm_p: float | None, mean_difference: float, alpha: float,
             equivalence_posterior: float) -> tuple[str, str]:
    if p_rope >= equivalence_posterior:
        return EQUIVALENT, "Bayesian signed-rank test, ROPE"
    if holm_p is not None and holm_p < alpha:
        return (WORSE if mean_difference > 0 else BETTER), "Wilcoxon signed-rank, Holm"
    return NOT_SEPARATED, "Wilcoxon signed-rank, Holm; Bayesian signed-rank test, ROPE"


def compare_strategies(test: Mapping[str, Mapping[str, float]], cv: Mapping[str, Mapping[str, float]],
                       layers: Mapping[str, int], *, held_out: Mapping[tuple[str, str], HeldOutCell] | None = None,
                       rope: float = DEFAULT_ROPE, alpha: float = ALPHA,
                       equivalence_posterior: float = EQUIVALENCE_POSTERIOR, power: float = TARGET_POWER,
                       n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95,
                       posterior_samples: int = POSTERIOR_SAMPLES, measure: str = "test_auroc") -> StrategyVerdicts:
    """The CV-chosen best and every other strategy's verdict against it.

    `test` and `cv` map strategy -> concept -> held-out / out-of-fold AUROC at the strategy's CV-chosen layer
    (`layers`); only concepts every strategy was scored on count. `held_out` (per-passage scores, keyed
    (concept, strategy)) adds the paired bootstrap over matched pairs. `measure` names what `test` holds (the held-out
    AUROC, or the declared tier estimand D1_mix), recorded with the verdicts."""
    strategies = sorted(test)
    if len(strategies) < 2:
        raise ProbeError(f"compare_strategies: needs at least two strategies, got {len(strategies)}")
    concepts = sorted(set.intersection(*(set(test[s]) for s in strategies)))
    if len(concepts) < 2:
        raise ProbeError(f"compare_strategies: needs at least two concepts every strategy was scored on, got "
                         f"{len(concepts)}")
    matrix = np.array([[float(test[s][c]) for s in strategies] for c in concepts])  # [n, k]
    cv_means = {s: float(np.mean([cv[s][c] for c in concepts])) for s in strategies}
    best = choose_on_cv(cv_means)
    b = strategies.index(best)
    test_means = matrix.mean(axis=0)
    low, high = rank_intervals(matrix, n_bootstrap=n_bootstrap, seed=seed, level=level)
    others = [s for s in strategies if s != best]
    diffs = {s: matrix[:, b] - matrix[:, strategies.index(s)] for s in others}
    tests = {s: wilcoxon_p(diffs[s]) for s in others}
    raw = [tests[s][1] or 1.0 for s in others]
    holm = holm_adjusted(raw)
    strictest = alpha / len(others)  # Holm's first step: what a new comparison would have to clear
    comparisons = []
    best_resamples = None  # the best's side of every paired bootstrap, computed at the first
    for s, holm_p in zip(others, holm, strict=True):
        j = strategies.index(s)
        mean_d = float(diffs[s].mean())
        p_best, p_rope, p_other = bayesian_signed_rank(matrix[:, b], matrix[:, j], rope,
                                                       nsamples=posterior_samples, seed=seed)
        verdict, words = _verdict(p_rope, float(holm_p), mean_d, alpha, equivalence_posterior)
        near = _near_tie(verdict, mean_d, p_rope, float(holm_p), holm_near_tie(diffs, s, raw, others, alpha),
                         alpha=alpha, equivalence_posterior=equivalence_posterior, nsamples=posterior_samples)
        pairs = None
        if held_out is not None and all((c, x) in held_out for c in concepts for x in (best, s)):
            best_cells = [held_out[(c, best)] for c in concepts]
            if best_resamples is None:
                best_resamples = concept_resamples(best_cells, n_bootstrap=n_bootstrap, seed=seed)
            pairs = pairs_bootstrap(best_cells, [held_out[(c, s)] for c in concepts], n_bootstrap=n_bootstrap,
                                    seed=seed, level=level, best_resamples=best_resamples)
        comparisons.append(Comparison(
            strategy=s, layer=int(layers[s]), verdict=verdict, test=words, n_concepts=len(concepts),
            mean_difference=mean_d, sd_difference=float(diffs[s].std(ddof=1)),
            wilcoxon_statistic=tests[s][0], wilcoxon_p=tests[s][1], holm_p=float(holm_p),
            p_best_better=p_best, p_rope=p_rope, p_other_better=p_other,
            concepts_to_separate=concepts_to_separate(diffs[s], strictest, power),
            rank_low=int(low[j]), rank_high=int(high[j]), in_confidence_set=bool(low[j] == 1), pairs=pairs,
            near_tie=near))
    comparisons.sort(key=lambda c: (c.mean_difference, c.strategy))
    top = strategies[int(np.argmax(test_means))]
    by = {c.strategy: c for c in comparisons}
    confirmation = (CONFIRMED if top == best or test_means[strategies.index(top)] <= test_means[b]
                    else CONTRADICTED if by[top].verdict == BETTER else NOT_CONTRADICTED)
    choice = BestChoice(best, int(layers[best]), cv_means[best], float(test_means[b]), top,
                        float(test_means[strategies.index(top)]), confirmation, len(concepts))
    confidence_set = tuple(s for s in strategies if low[strategies.index(s)] == 1)
    needed = [c.concepts_to_separate for c in comparisons if c.verdict == NOT_SEPARATED]
    return StrategyVerdicts(
        best=choice, comparisons=tuple(comparisons), confidence_set=confidence_set, rope=rope, alpha=alpha,
        equivalence_posterior=equivalence_posterior, power=power, n_bootstrap=n_bootstrap, level=level,
        concepts_needed=None if not needed or any(n is None for n in needed) else max(n for n in needed if n),
        measure=measure)
