"""The ranking's declared estimand over the corpus tiers: within-tier D1 mixed at a stated weight, not the blend a
split happens to hold.

A test split that mixes the tiers unlike the train split, or unlike another corpus size, sets the overall test
AUROC by its own proportions (`small`: train 12 standard + 6 hard pairs, test 6 + 8): a strategy strong on standard
pairs and weak on hard ones ranks by how many hard pairs the test split drew. The estimand here is
D1_mix(concept) = sum over tiers of TIER_MIX[tier] * AUROC_tier(concept), each strategy at its CV-chosen layer with
the tier AUROCs of results.json's d1_by_tier (positives against negatives of the same concept and tier, never their
own twin), averaged over the concepts that have every tier, with a Student-t interval over those concepts. Equal
weights: the hard tier is the question the tiers exist to ask (do the words alone decide?), the standard tier the
question D1 always asked, and neither should count for more because a split drew more of its pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from poolbench.corpus.passage import TIERS, Passage
from poolbench.records.breakdowns import TierAurocRecord
from poolbench.results.answer.ranking import mean_t_interval

TIER_MIX: dict[str, float] = {"standard": 0.5, "hard": 0.5}
ESTIMAND = "tier_mixed_d1"


def tier_pair_counts(passages_by_concept: Mapping[str, Sequence[Passage]]) -> dict[str, dict[str, int]]:
    """Matched pairs per split and tier over every concept ({} when no passage records a tier): the mix the
    overall D1 blends."""
    pairs: dict[str, dict[str, set]] = {}
    for concept, passages in passages_by_concept.items():
        for p in passages:
            if p.tier is not None:
                pairs.setdefault(p.split, {}).setdefault(p.tier, set()).add((concept, p.group))
    return {split: {tier: len(pairs[split].get(tier, ())) for tier in TIERS} for split in sorted(pairs)}


def _hard_share(counts: Mapping[str, int]) -> float | None:
    total = sum(counts.values())
    return None if total == 0 else counts.get("hard", 0) / total


def tier_mixed_ranking(tiers: Sequence[TierAurocRecord], mix: Mapping[str, float] = TIER_MIX,
                       pair_counts: Mapping[str, Mapping[str, int]] | None = None) -> dict:
    """The declared estimand and the strategies ranked on it (best first); {} when the run has no tier records."""
    if not tiers:
        return {}
    if set(mix) != set(TIERS) or any(w < 0 for w in mix.values()) or not np.isclose(sum(mix.values()), 1.0):
        raise ValueError(f"tier mix {dict(mix)} must weigh each of {', '.join(TIERS)} >= 0, summing to 1")
    by_cell: dict[tuple[str, int], dict[str, dict]] = {}
    for r in tiers:
        by_cell.setdefault((r.strategy, r.layer), {})[r.tier] = r.concept_aurocs
    rows = []
    for (strategy, layer), per_tier in by_cell.items():
        concepts = sorted(set.intersection(*(
            {c for c, v in per_tier.get(t, {}).items() if v is not None} for t in TIERS)))
        if not concepts:
            continue
        values = [sum(mix[t] * float(per_tier[t][c]) for t in TIERS) for c in concepts]
        mean, low, high = mean_t_interval(values)
        rows.append({"strategy": strategy, "layer": layer, "d1_mix": mean, "ci_low": low, "ci_high": high,
                     "n_concepts": len(concepts), "per_concept": dict(zip(concepts, values, strict=True))})
    rows.sort(key=lambda r: (-r["d1_mix"], r["strategy"]))
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    counts = {split: dict(c) for split, c in (pair_counts or {}).items()}
    return {"estimand": ESTIMAND, "mix": dict(mix),
            "definition": "per concept, sum over tiers of mix[tier] x that tier's held-out AUROC (positives against "
                          "negatives of the same concept and tier, never their own twin) at the strategy's "
                          "CV-chosen layer; mean over concepts with every tier, Student-t 95% interval",
            "split_pairs": counts,
            "split_hard_share": {split: _hard_share(c) for split, c in counts.items()},
            "overall_d1_note": "test_auroc (and the ranking on it) blends the tiers at the test split's own mix",
            "rows": rows, "best": rows[0]["strategy"] if rows else None}


def estimand_sentence(section: Mapping) -> str | None:
    """One sentence for the answer: the declared estimand, the strategy first on it (the held-out order; the best
    is chosen on CV) and the split's own mix."""
    rows = section.get("rows") or []
    if not rows:
        return None
    top = rows[0]
    mix = ", ".join(f"{t} {w:g}" for t, w in section["mix"].items())
    share = (section.get("split_hard_share") or {}).get("test")
    blend = "" if share is None else f"; the overall D1 blends them at the test split's {share:.0%} hard pairs"
    interval = "" if top["ci_low"] is None else f" [{top['ci_low']:.3f}, {top['ci_high']:.3f}]"
    return (f"Ranked on the declared estimand (within-tier D1 mixed {mix}{blend}): first {top['strategy']} at "
            f"layer {top['layer']}, {top['d1_mix']:.3f}{interval} over {top['n_concepts']} concepts.")
