"""Does a strategy ranking hold across models? Kendall's W over per-model rankings, with a permutation p-value
and a bootstrap interval over concepts (pure numpy/scipy: arrays in, numbers out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from poolbench.prober.auroc import ProbeError


def rank_rows(scores: np.ndarray) -> np.ndarray:
    """Ranks within each row (a model), 1 = highest score, ties given their average rank as Friedman does."""
    return rankdata(-np.asarray(scores, dtype=np.float64), method="average", axis=-1)


def _check(scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] < 2 or scores.shape[1] < 2 or not np.isfinite(scores).all():
        raise ProbeError(f"Kendall's W: needs finite scores of >= 2 models x >= 2 strategies, got {scores.shape}")
    return scores


def kendall_w_of_ranks(ranks: np.ndarray) -> np.ndarray:
    """W of [..., m, n] rank matrices (m raters, n objects), tie-corrected: 12 S / (m²(n³ − n) − m Σ(t³ − t)).

    Equals Friedman's tie-corrected χ² / (m (n − 1)); a rater whose ranks are all tied contributes no spread,
    and W is undefined (nan) when every rater ties everything.
    """
    ranks = np.asarray(ranks, dtype=np.float64)
    m, n = ranks.shape[-2:]
    column_sums = ranks.sum(axis=-2)
    s = ((column_sums - m * (n + 1) / 2.0) ** 2).sum(axis=-1)
    ties = _tie_term(ranks)
    denominator = m * m * (n ** 3 - n) - m * ties
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, 12.0 * s / np.where(denominator > 0, denominator, 1.0), np.nan)


def _tie_term(ranks: np.ndarray) -> np.ndarray:
    """Σ over raters and tie groups of t³ − t: each of a group's t members sees t equal values, and
    Σ over members of (t² − 1) is t³ − t (midranks of a group are equal, so equality finds the group)."""
    equal = (ranks[..., :, None] == ranks[..., None, :]).sum(axis=-1)
    return ((equal ** 2) - 1).sum(axis=(-2, -1)).astype(np.float64)


def kendall_w(scores: np.ndarray) -> float:
    """Kendall's W of [m models, n strategies] scores (higher = better): 1 when every model ranks the strategies
    alike, near 0 when rankings are unrelated."""
    return float(kendall_w_of_ranks(rank_rows(_check(scores))))


def permutation_p_value(scores: np.ndarray, n_permutations: int = 9999, seed: int = 0) -> float:
    """P(W ≥ observed) when each model's ranking is shuffled independently (the null: no agreement), counted
    with the observed ranking among the permutations so p is never 0: (1 + #{W* ≥ W}) / (1 + B)."""
    ranks = rank_rows(_check(scores))
    observed = float(kendall_w_of_ranks(ranks))
    if not np.isfinite(observed):  # every model ties every strategy: there is no ranking to agree on
        return float("nan")
    rng = np.random.default_rng(seed)
    m, n = ranks.shape
    keys = rng.random((n_permutations, m, n))
    shuffled = np.take_along_axis(np.broadcast_to(ranks, keys.shape), np.argsort(keys, axis=-1), axis=-1)
    # Shuffling permutes each row's values, so the tie term (hence the denominator) stays the observed one.
    s_null = ((shuffled.sum(axis=-2) - m * (n + 1) / 2.0) ** 2).sum(axis=-1)
    null = 12.0 * s_null / (m * m * (n ** 3 - n) - m * float(_tie_term(ranks)))
    # A W equal to the observed one up to float rounding counts as reaching it (S is a sum of m·n ranks).
    tolerance = 1e-12 * max(1.0, abs(observed))
    return float((1 + np.count_nonzero(null >= observed - tolerance)) / (1 + n_permutations))


def bootstrap_interval(per_concept: np.ndarray, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95
                       ) -> tuple[float | None, float | None]:
    """Percentile interval of W over concept resamples: [m models, n strategies, c concepts] D1 values, the same
    concepts drawn for every model (they share the corpus), each model's strategy means recomputed and ranked.

    The layer each (model, strategy) uses stays the one chosen on all concepts' CV, so the interval covers the
    concept sample, not the layer choice. None, None with fewer than two concepts or only undefined resamples.
    """
    values = np.asarray(per_concept, dtype=np.float64)
    if values.ndim != 3 or not np.isfinite(values).all():
        raise ProbeError(f"Kendall's W interval: needs finite [models, strategies, concepts] D1, got {values.shape}")
    c = values.shape[2]
    if c < 2:
        return None, None
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, c, size=(n_bootstrap, c))
    means = values[:, :, draws].mean(axis=-1).transpose(2, 0, 1)  # [B, m, n]
    ws = kendall_w_of_ranks(rank_rows(means))
    ws = ws[np.isfinite(ws)]
    if ws.size == 0:
        return None, None
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(ws, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Concordance:
    """Kendall's W across models with its permutation p-value and concept-bootstrap interval."""

    w: float
    p_value: float
    ci_low: float | None
    ci_high: float | None
    n_models: int
    n_strategies: int
    n_concepts: int
    n_permutations: int
    n_bootstrap: int

    def to_dict(self) -> dict:
        return {"kendall_w": self.w, "p_value": self.p_value, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "n_models": self.n_models, "n_strategies": self.n_strategies, "n_concepts": self.n_concepts,
                "n_permutations": self.n_permutations, "n_bootstrap": self.n_bootstrap,
                "p_value_method": "permutation: each model's ranking shuffled independently, (1 + #{W* >= W})/(1 + B)",
                "interval_method": "95% percentile bootstrap over concepts (the same concepts for every model), "
                                   "layers fixed at each model's CV choice"}


def concordance(per_concept: np.ndarray, *, n_permutations: int = 9999, n_bootstrap: int = 1000, seed: int = 0
                ) -> Concordance:
    """W of the models' rankings by mean D1 over concepts, from [m models, n strategies, c concepts] D1."""
    values = np.asarray(per_concept, dtype=np.float64)
    if values.ndim != 3:
        raise ProbeError(f"Kendall's W: needs [models, strategies, concepts] D1, got shape {values.shape}")
    means = values.mean(axis=-1)
    low, high = bootstrap_interval(values, n_bootstrap, seed)
    return Concordance(kendall_w(means), permutation_p_value(means, n_permutations, seed), low, high,
                       values.shape[0], values.shape[1], values.shape[2], n_permutations, n_bootstrap)
