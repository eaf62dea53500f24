"""D2 arithmetic on arrays: SCP with a prompt-bootstrap CI, the fluency guard (fluency.py), the AxBench-style
alpha* split.

Layout: every per-generation array is [A, N], one row per alpha (ascending, alphas[0] == 0) and one
column per prompt; a prompt keeps its column (and its sampling seed) across alphas, so comparisons pair.
`nll_sum`/`n_tokens` are each continuation's NLL under the reference model, unconditioned on its prompt, and
`distinct` its distinct-2 (fluency.py); None leaves repetition unchecked (arrays built by hand).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import rankdata

from .errors import SteeringError
from .fluency import DEFAULT_FLUENCY_GUARD, DEFAULT_MIN_DISTINCT, passes_guard

# 4: the guard reads reference-model perplexity unconditioned on the prompt and distinct-2, for steering and prompting
# 3: alpha* among alpha > 0 with its outcome and stability; both halves' rows; prompted guard
D2_VERSION = 4
N_HALVINGS = 200  # resampled selection/report halvings behind alpha*'s stability


def _pearson_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise Pearson correlation of [B, M] arrays; NaN where a row is constant."""
    x = x - x.mean(axis=1, keepdims=True)
    y = y - y.mean(axis=1, keepdims=True)
    den = np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (x * y).sum(axis=1) / np.where(den > 0, den, 1.0), np.nan)


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho per row (average ranks for ties), as scipy.stats.spearmanr on each row."""
    return _pearson_rows(rankdata(x, axis=1), rankdata(y, axis=1))


def _check(alphas: Sequence[float], scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(alphas, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != a.size or s.shape[1] < 1:
        raise SteeringError(f"D2: scores {s.shape} must be [n_alphas={a.size}, n_prompts >= 1]")
    if a[0] != 0.0 or np.any(np.diff(a) <= 0):
        raise SteeringError(f"D2: alphas {a.tolist()} must ascend from 0")
    return a, s


def scp(alphas: Sequence[float], scores: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0,
        level: float = 0.95) -> dict:
    """Spearman rho between alpha and score over all generations; CI by resampling prompts (columns).

    A resample whose scores are all equal has no rank order to correlate with alpha: it counts as rho = 0
    (no association observed) rather than being dropped, which would keep only the resamples that happened
    to draw the few prompts carrying an effect. `scp_degenerate_replicates` says how many there were.
    """
    a, s = _check(alphas, scores)
    n_alpha, n = s.shape
    flat_a = np.repeat(a, n)[None, :]
    rho = float(spearman_rows(flat_a, s.reshape(1, -1))[0])
    out = {"scp": None if np.isnan(rho) else rho, "scp_ci_low": None, "scp_ci_high": None,
           "scp_n_generations": int(s.size), "scp_n_bootstrap": 0, "scp_degenerate_replicates": 0}
    if n_bootstrap > 0 and n > 1 and not np.isnan(rho):
        cols = np.random.default_rng(seed).integers(0, n, size=(n_bootstrap, n))
        boot_s = s[:, cols].transpose(1, 0, 2).reshape(n_bootstrap, n_alpha * n)
        boot = spearman_rows(np.broadcast_to(flat_a, boot_s.shape), boot_s)
        degenerate = np.isnan(boot)
        boot = np.where(degenerate, 0.0, boot)
        tail = (1.0 - level) / 2.0
        low, high = np.quantile(boot, [tail, 1.0 - tail])
        out.update(scp_ci_low=float(low), scp_ci_high=float(high), scp_n_bootstrap=int(n_bootstrap),
                   scp_degenerate_replicates=int(degenerate.sum()))
    return out


def split_prompts(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint halves of prompt indices: alpha* is chosen on the first, reported on the second."""
    if n < 2:
        raise SteeringError(f"D2 needs at least 2 prompts to split into selection and report halves, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    half = n // 2
    return np.sort(order[:half]), np.sort(order[half:])


def perplexity(nll_sum: np.ndarray, n_tokens: np.ndarray) -> float | None:
    """exp(total NLL / total tokens) over a set of generations; None when they hold no tokens."""
    total = float(np.sum(n_tokens))
    return float(np.exp(np.sum(nll_sum) / total)) if total > 0 else None


def harmonic_mean(values: Sequence[float]) -> float:
    v = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0)
    return 0.0 if np.any(v <= 0) else float(v.size / np.sum(1.0 / v))


def _mean_or_none(values: np.ndarray | None, row: int, idx: np.ndarray) -> float | None:
    return None if values is None else float(np.mean(np.asarray(values)[row, idx]))


def alpha_table(alphas: Sequence[float], scores: np.ndarray, nll_sum: np.ndarray, n_tokens: np.ndarray,
                relevance: np.ndarray, idx: np.ndarray, distinct: np.ndarray | None = None) -> list[dict]:
    """Per alpha on the prompts `idx`: mean concept score, reference perplexity and its ratio to alpha = 0, mean
    distinct-2, mean relevance, each mapped to [0, 1] (fluency as min(1, ppl_0 / ppl)), and their harmonic mean."""
    a, s = _check(alphas, scores)
    ppl0 = perplexity(nll_sum[0, idx], n_tokens[0, idx])
    rows = []
    for i, alpha in enumerate(a):
        ppl = perplexity(nll_sum[i, idx], n_tokens[i, idx])
        ratio = ppl / ppl0 if ppl is not None and ppl0 is not None else None
        score = float(np.mean(s[i, idx]))
        rel = float(np.mean(relevance[i, idx]))
        fluency01 = 0.0 if ratio is None else min(1.0, 1.0 / ratio)
        rows.append({"alpha": float(alpha), "score": score, "perplexity": ppl, "fluency_ratio": ratio,
                     "distinct_2": _mean_or_none(distinct, i, idx), "relevance": rel, "fluency01": fluency01,
                     "hm": harmonic_mean([score, fluency01, max(rel, 0.0)])})
    return rows


def choose_alpha(table: list[dict], guard: float = DEFAULT_FLUENCY_GUARD,
                 min_distinct: float = DEFAULT_MIN_DISTINCT) -> tuple[int, str]:
    """(index of alpha*, outcome): the best harmonic mean among alphas > 0 that pass the guard, ties to
    the smaller alpha. alpha = 0 is never a candidate (it would make Delta = 0 a structural result): outcome
    'no_alpha_helps' when alpha*'s harmonic mean does not beat alpha = 0's, 'no_alpha_fluent' (index 0) when no
    alpha > 0 passes the guard, else 'chosen'."""
    ok = [i for i, r in enumerate(table)
          if i > 0 and passes_guard(r["fluency_ratio"], r.get("distinct_2"), guard=guard, min_distinct=min_distinct)]
    if not ok:
        return 0, "no_alpha_fluent"
    best = max(ok, key=lambda i: (table[i]["hm"], -i))
    return best, "chosen" if table[best]["hm"] > table[0]["hm"] else "no_alpha_helps"


def alpha_star_stability(alphas: Sequence[float], scores: np.ndarray, nll_sum: np.ndarray, n_tokens: np.ndarray,
                         relevance: np.ndarray, chosen: str, *, guard: float = DEFAULT_FLUENCY_GUARD,
                         n_halvings: int = N_HALVINGS, seed: int = 0, distinct: np.ndarray | None = None,
                         min_distinct: float = DEFAULT_MIN_DISTINCT) -> dict:
    """alpha* over `n_halvings` other random selection halves (seeds seed+1, ...): how often each alpha is chosen
    ("none": no fluent alpha), and the share agreeing with the reported choice `chosen` (a key of those counts)."""
    a, s = _check(alphas, scores)
    counts: dict[str, int] = {}
    for k in range(1, n_halvings + 1):
        select, _ = split_prompts(s.shape[1], seed + k)
        index, outcome = choose_alpha(alpha_table(a, s, nll_sum, n_tokens, relevance, select, distinct), guard,
                                      min_distinct)
        key = _alpha_key(a, index, outcome)
        counts[key] = counts.get(key, 0) + 1
    return {"alpha_star_counts": dict(sorted(counts.items())), "n_halvings": n_halvings,
            "alpha_star_stability": counts.get(chosen, 0) / n_halvings if n_halvings else None}


def _alpha_key(alphas: np.ndarray, index: int, outcome: str) -> str:
    return "none" if outcome == "no_alpha_fluent" else repr(float(alphas[index]))


def paired_delta(values: np.ndarray, baseline: np.ndarray, *, n_bootstrap: int = 1000, seed: int = 0,
                 level: float = 0.95) -> dict:
    """Mean of (values - baseline) over prompts with a percentile CI from resampling prompts."""
    d = np.asarray(values, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if d.size == 0:
        raise SteeringError("paired delta over zero prompts")
    out = {"delta": float(d.mean()), "ci_low": None, "ci_high": None}
    if n_bootstrap > 0:
        idx = np.random.default_rng(seed).integers(0, d.size, size=(n_bootstrap, d.size))
        means = d[idx].mean(axis=1)
        tail = (1.0 - level) / 2.0
        low, high = np.quantile(means, [tail, 1.0 - tail])
        out.update(ci_low=float(low), ci_high=float(high))
    return out


def d2_summary(alphas: Sequence[float], scores: np.ndarray, nll_sum: np.ndarray, n_tokens: np.ndarray,
               relevance: np.ndarray, *, guard: float = DEFAULT_FLUENCY_GUARD, n_bootstrap: int = 1000,
               seed: int = 0, distinct: np.ndarray | None = None, min_distinct: float = DEFAULT_MIN_DISTINCT) -> dict:
    """SCP over all prompts; alpha* (> 0) chosen on one half with its outcome and its stability over resampled
    halvings, Delta(alpha*) with its CI on the other half; both halves' per-alpha rows."""
    a, s = _check(alphas, scores)
    select, report = split_prompts(s.shape[1], seed)
    select_table = alpha_table(a, s, nll_sum, n_tokens, relevance, select, distinct)
    chosen, outcome = choose_alpha(select_table, guard, min_distinct)
    report_table = alpha_table(a, s, nll_sum, n_tokens, relevance, report, distinct)
    stability = alpha_star_stability(a, s, nll_sum, n_tokens, relevance, _alpha_key(a, chosen, outcome),
                                     guard=guard, seed=seed, distinct=distinct, min_distinct=min_distinct)
    delta = paired_delta(s[chosen, report], s[0, report], n_bootstrap=n_bootstrap, seed=seed)
    star = report_table[chosen]
    return {
        **scp(a, s, n_bootstrap=n_bootstrap, seed=seed),
        "alpha_star": float(a[chosen]), "alpha_star_index": int(chosen), "alpha_star_outcome": outcome,
        **stability,
        "d2_delta": delta["delta"], "d2_delta_ci_low": delta["ci_low"], "d2_delta_ci_high": delta["ci_high"],
        "score_at_alpha_star": star["score"], "score_at_zero": report_table[0]["score"],
        "fluency_ratio": star["fluency_ratio"], "fluency_guard": guard, "distinct_2": star["distinct_2"],
        "min_distinct_2": min_distinct if distinct is not None else None,
        "passes_fluency_guard": passes_guard(star["fluency_ratio"], star["distinct_2"], guard=guard,
                                             min_distinct=min_distinct),
        "relevance": star["relevance"], "perplexity_at_zero": report_table[0]["perplexity"],
        "select_prompts": select.tolist(), "report_prompts": report.tolist(),
        "per_alpha": report_table, "per_alpha_select": select_table,
    }


def prompted_summary(scores_p: np.ndarray, nll_p: np.ndarray, ntok_p: np.ndarray, relevance_p: np.ndarray,
                     scores0: np.ndarray, nll0: np.ndarray, ntok0: np.ndarray, report: np.ndarray, *,
                     n_bootstrap: int = 1000, seed: int = 0, guard: float = DEFAULT_FLUENCY_GUARD,
                     distinct_p: np.ndarray | None = None, min_distinct: float = DEFAULT_MIN_DISTINCT) -> dict:
    """The prompted baseline (instruction prefix, unsteered) on the report half, beside alpha*, held to the
    fluency guard steering must pass (`prompted_passes_fluency_guard`; None when its perplexity is undefined):
    its continuations' reference perplexity against the unsteered ones' and their distinct-2."""
    ppl_p = perplexity(nll_p[report], ntok_p[report])
    ppl_0 = perplexity(nll0[report], ntok0[report])
    delta = paired_delta(scores_p[report], scores0[report], n_bootstrap=n_bootstrap, seed=seed)
    ratio = ppl_p / ppl_0 if ppl_p is not None and ppl_0 is not None else None
    distinct = None if distinct_p is None else float(np.mean(np.asarray(distinct_p)[report]))
    return {"prompted_score": float(np.mean(scores_p[report])), "prompted_delta": delta["delta"],
            "prompted_delta_ci_low": delta["ci_low"], "prompted_delta_ci_high": delta["ci_high"],
            "prompted_fluency_ratio": ratio, "prompted_relevance": float(np.mean(relevance_p[report])),
            "prompted_distinct_2": distinct,
            "prompted_passes_fluency_guard": passes_guard(ratio, distinct, guard=guard, min_distinct=min_distinct)}
