"""The answer's words for the prober's verdicts (poolbench.prober.verdicts): whether the held-out test confirms the
CV-chosen best, each verdict with the test it rests on, the confidence set for the best, and how many concepts
would separate what this run could not. Words only: every number is read from the StrategyVerdicts record."""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.records.verdicts import (
    BETTER,
    CONFIRMED,
    CONTRADICTED,
    EQUIVALENT,
    NOT_SEPARATED,
    WORSE,
    Comparison,
    StrategyVerdicts,
)

MAX_NAMED = 8


def p_text(value: float | None) -> str:
    """A p value as every answer sentence prints it: two significant digits below 0.01, else three decimals."""
    return "n/a" if value is None else f"{value:.2g}" if value < 0.01 else f"{value:.3f}"


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:MAX_NAMED])
    return shown + (f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else "")


def near_tie_text(c: Comparison) -> str:
    """A verdict at its test's boundary, in words: what is near what, and what it would read across."""
    t = c.near_tie
    if t is None:
        return ""
    return (f"near-tie: {t.boundary}, {p_text(t.value)} against {t.threshold:g}, within {t.within} of "
            f"{p_text(t.other_side)}, where it would read '{t.other_verdict}'")


def near_tie_sentence(v: StrategyVerdicts) -> str | None:
    """One sentence naming every verdict at its test's boundary, or None."""
    near = [c for c in v.comparisons if c.near_tie is not None]
    if not near:
        return None
    return ("At a test's boundary (near-ties, which another CPU's round-off or another posterior draw may resolve "
            "the other way): " + "; ".join(f"{c.strategy} '{c.verdict}' ({near_tie_text(c)})" for c in near) + ".")


def choice_sentence(v: StrategyVerdicts) -> str:
    """Does the held-out test confirm the best chosen on CV?"""
    b = v.best
    mean = "held-out mean D1_mix" if v.measure == "tier_mixed_d1" else "held-out mean"
    if b.confirmation == CONFIRMED:
        return (f"The held-out test confirms the choice: no strategy has a higher {mean} than {b.strategy} "
                f"({b.test_mean:.3f}).")
    top = next(c for c in v.comparisons if c.strategy == b.test_top)
    if b.confirmation == CONTRADICTED:
        return (f"The held-out test contradicts the choice: {b.test_top} is ahead of {b.strategy} "
                f"({b.test_top_mean:.3f} against {b.test_mean:.3f}; Wilcoxon signed-rank, Holm p = "
                f"{p_text(top.holm_p)}, n = {top.n_concepts} concepts).")
    return (f"The held-out test does not confirm it: {b.test_top} has the higher {mean} ({b.test_top_mean:.3f} "
            f"against {b.test_mean:.3f}), a difference the tests do not separate (Wilcoxon-Holm p = "
            f"{p_text(top.holm_p)}, n = {top.n_concepts}).")


def verdict_sentences(v: StrategyVerdicts) -> list[str]:
    """One sentence per verdict that occurs, naming the test, then the confidence set and the concepts needed."""
    by = {verdict: [c for c in v.comparisons if c.verdict == verdict] for verdict in (WORSE, EQUIVALENT,
                                                                                       NOT_SEPARATED, BETTER)}
    n = v.best.n_concepts
    out = []
    if by[WORSE]:
        on = " on held-out D1_mix" if v.measure == "tier_mixed_d1" else ""
        out.append(f"Worse than the best ({len(by[WORSE])}; Wilcoxon signed-rank{on} over {n} concepts, Holm's "
                   f"step-down, α = {v.alpha}): "
                   + _names([f"{c.strategy} (Holm p {p_text(c.holm_p)})" for c in by[WORSE]]) + ".")
    if by[EQUIVALENT]:
        out.append(f"Practically equivalent to the best ({len(by[EQUIVALENT])}; Bayesian signed-rank test, ROPE "
                   f"±{v.rope:g} AUROC, posterior ≥ {v.equivalence_posterior:g}): "
                   + _names([f"{c.strategy} (P(ROPE) {c.p_rope:.3f})" for c in by[EQUIVALENT]]) + ".")
    if by[NOT_SEPARATED]:
        out.append(f"Not separated from the best ({len(by[NOT_SEPARATED])}; neither Wilcoxon-Holm at α = {v.alpha} "
                   f"nor the ROPE posterior decides): "
                   + _names([f"{c.strategy} (Holm p {p_text(c.holm_p)}, P(ROPE) {c.p_rope:.3f})"
                             for c in by[NOT_SEPARATED]]) + ".")
    if by[BETTER]:
        out.append(f"Better than the chosen best on the held-out test ({len(by[BETTER])}; Wilcoxon-Holm): "
                   + _names([f"{c.strategy} (Holm p {p_text(c.holm_p)})" for c in by[BETTER]]) + ".")
    out.append(f"Confidence set for the best ({round(100 * v.level)}% bootstrap rank intervals over concepts "
               f"that reach rank 1, {v.n_bootstrap} resamples): {_names(list(v.confidence_set))}.")
    if by[NOT_SEPARATED]:
        if v.concepts_needed is None:
            out.append("No number of concepts would separate all of them: the mean difference from the best is 0 "
                       "for " + _names([c.strategy for c in by[NOT_SEPARATED] if c.concepts_to_separate is None])
                       + ".")
        else:
            out.append(f"Separating them would take about {v.concepts_needed} concepts (a paired t-test with "
                       f"power {v.power:g} at Holm's strictest α, taking the observed spread of the per-concept "
                       f"differences as the truth); this run has {n}.")
    if near := near_tie_sentence(v):
        out.append(near)
    pairs = [c for c in v.comparisons if c.pairs is not None]
    if pairs:
        above = sum(1 for c in pairs if c.pairs is not None and c.pairs.low > 0)
        blend = " (overall, the tiers' blend)" if v.measure == "tier_mixed_d1" else ""
        out.append(f"On these concepts (a paired bootstrap over matched pairs, which says nothing of other "
                   f"concepts) the best's mean held-out AUROC{blend} lies above {above} of {len(pairs)} others at "
                   f"{round(100 * v.level)}%.")
    return out


def comparison_line(c: Comparison) -> str:
    """One strategy's verdict with every number behind it, for the terminal and the report's table."""
    pairs = "" if c.pairs is None else (f"; on these concepts Δ {c.pairs.difference:+.3f} "
                                        f"[{c.pairs.low:+.3f}, {c.pairs.high:+.3f}] over {c.pairs.n_pairs} pairs")
    need = "" if c.concepts_to_separate is None else f"; ~{c.concepts_to_separate} concepts to separate"
    w = "n/a" if c.wilcoxon_statistic is None else f"{c.wilcoxon_statistic:g}"
    near = "" if c.near_tie is None else f"; {near_tie_text(c)}"
    return (f"  {c.strategy} L{c.layer}: {c.verdict} ({c.test}) — best minus it {c.mean_difference:+.3f} over "
            f"{c.n_concepts} concepts; Wilcoxon W {w}"
            f", p {p_text(c.wilcoxon_p)}, Holm p {p_text(c.holm_p)}; P(best better / ROPE / it better) "
            f"{c.p_best_better:.3f} / {c.p_rope:.3f} / {c.p_other_better:.3f}; rank [{c.rank_low}, {c.rank_high}]"
            f"{need}{pairs}{near}")
