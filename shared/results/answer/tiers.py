"""The leaderboard's per-tier section: strategies ranked on each tier, and whether the best one's interval
separates it from the others (the question the hard tier exists to answer)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.corpus.passage import TIERS
from poolbench.records.breakdowns import LexicalTierRecord, TierAurocRecord

SEPARATES_SHARE = 1 / 3
"""The best strategy separates a tier when its CI lies above chance and above at least this share of the other
strategies' AUROCs (a best one at chance separates nothing, whatever lies below it)."""


def tier_section(tiers: Sequence[TierAurocRecord], lexical: Sequence[LexicalTierRecord] = ()) -> dict:
    """Per tier: rows best first (AUROC with CI), how many others the best one's CI excludes, and the lexical
    baseline over concepts (mean and max) beside them."""
    out: dict[str, dict] = {}
    for tier in TIERS:
        rows = sorted((r for r in tiers if r.tier == tier and r.auroc is not None),
                      key=lambda r: (-float(r.auroc or 0.0), r.strategy))
        lex = {r.concept: float(r.test_auroc) for r in lexical if r.tier == tier}
        if not rows and not lex:
            continue
        section: dict = {"rows": [{"strategy": r.strategy, "layer": r.layer, "auroc": r.auroc, "ci_low": r.ci_low,
                                   "ci_high": r.ci_high, "auroc_with_twins": r.auroc_with_twins, "n": r.n,
                                   "n_concepts": r.n_concepts} for r in rows]}
        if rows:
            best, others = rows[0], rows[1:]
            excluded = [r.strategy for r in others if best.ci_low is not None and float(r.auroc or 0.0) < best.ci_low]
            above_chance = best.ci_low is not None and best.ci_low > 0.5
            section |= {"best": best.strategy, "best_above_chance": above_chance, "n_others": len(others),
                        "n_excluded_by_best": len(excluded), "excluded_by_best": excluded,
                        "separates": above_chance and bool(others)
                        and len(excluded) >= SEPARATES_SHARE * len(others)}
        if lex:
            section["lexical"] = {"mean": float(np.mean(list(lex.values()))), "max": max(lex.values()),
                                  "per_concept": lex}
        out[tier] = section
    return out
