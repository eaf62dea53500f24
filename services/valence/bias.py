"""Valence bias between two checkpoints: arrays of word representations in, scores and bootstrap CIs out.

valence(w) = mean_p cos(h(w), h(p)) - mean_n cos(h(w), h(n)), with each checkpoint's own h for every word.
ΔValence = mean over domain words of valence_after - valence_before (a shift of the whole domain);
ΔVar = Var(valence_after) - Var(valence_before) (population variance over domain words), which grows when one
or a few words become favourites. CIs: paired percentile bootstrap over domain words (the same resampled words
on both sides), seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poolbench.errors import PoolBenchError


class ValenceBiasError(PoolBenchError):
    """Representations or word lists that the valence score cannot use."""


def cosine_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[A, B] cosine similarities of the rows of a [A, d] and b [B, d]; a zero vector is an error."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    if (na == 0).any() or (nb == 0).any():
        raise ValenceBiasError("cosine of a zero representation is undefined")
    return (a / na[:, None]) @ (b / nb[:, None]).T


def valence(domain: np.ndarray, positive: np.ndarray, negative: np.ndarray, *, centre: bool = False) -> np.ndarray:
    """[D] valence of each domain representation: mean cosine to the positive set minus to the negative.

    `centre` first subtracts the mean representation of all the words (domain, positive and negative) of this
    checkpoint: small LMs' hidden states share one dominant direction, so raw cosines are all near 1 and valence
    differences drown in it; centring compares the words' deviations from their common mean instead.
    """
    if len(domain) == 0 or len(positive) == 0 or len(negative) == 0:
        raise ValenceBiasError("valence needs at least one domain, one positive and one negative word")
    if centre:
        mean = np.concatenate([domain, positive, negative]).astype(np.float64).mean(axis=0)
        domain, positive, negative = domain - mean, positive - mean, negative - mean
    return cosine_matrix(domain, positive).mean(axis=1) - cosine_matrix(domain, negative).mean(axis=1)


@dataclass
class Interval:
    value: float
    ci_low: float
    ci_high: float

    @property
    def excludes_zero(self) -> bool:
        return self.ci_low > 0 or self.ci_high < 0

    def to_json(self) -> dict[str, float | bool]:
        return {"value": self.value, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "excludes_zero": self.excludes_zero}


@dataclass
class ValenceBias:
    delta_valence: Interval
    delta_var: Interval
    valence_before: np.ndarray  # [D]
    valence_after: np.ndarray  # [D]
    n_bootstrap: int
    confidence: float
    seed: int

    @property
    def shift(self) -> np.ndarray:
        return self.valence_after - self.valence_before


def delta_valence(before: np.ndarray, after: np.ndarray) -> float:
    return float(np.mean(np.asarray(after) - np.asarray(before)))


def delta_var(before: np.ndarray, after: np.ndarray) -> float:
    return float(np.var(after) - np.var(before))


def valence_bias(before: np.ndarray, after: np.ndarray, *, n_bootstrap: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> ValenceBias:
    """ΔValence and ΔVar with paired percentile-bootstrap CIs over domain words."""
    before, after = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if before.shape != after.shape or before.ndim != 1 or len(before) < 2:
        raise ValenceBiasError(f"valence_bias: need two [D >= 2] valence arrays, got {before.shape} and "
                               f"{after.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(before), size=(n_bootstrap, len(before)))
    b, a = before[idx], after[idx]
    boot_mean = (a - b).mean(axis=1)
    boot_var = a.var(axis=1) - b.var(axis=1)
    tail = (1 - confidence) / 2 * 100
    mean_lo, mean_hi = np.percentile(boot_mean, [tail, 100 - tail])
    var_lo, var_hi = np.percentile(boot_var, [tail, 100 - tail])
    return ValenceBias(
        delta_valence=Interval(delta_valence(before, after), float(mean_lo), float(mean_hi)),
        delta_var=Interval(delta_var(before, after), float(var_lo), float(var_hi)),
        valence_before=before, valence_after=after, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed,
    )


def mover_rank(shift: np.ndarray, index: int) -> tuple[int, int]:
    """(rank by rise, rank by |shift|) of word `index`, 1 = the top mover; ties rank in the word's favour."""
    shift = np.asarray(shift, dtype=np.float64)
    return int((shift > shift[index]).sum()) + 1, int((np.abs(shift) > abs(shift[index])).sum()) + 1
