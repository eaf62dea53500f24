"""The learning curve: D1 against training size, and whether (and from which size) each learned aggregator beats
the card's best. Each size is a whole run (`run --train-limit N`: at most N training passages per class, pairs
whole, the test split whole, so every size is scored on the same held-out passages); this module reads the runs'
leaderboards only.

At each size the card's best is the CV-chosen best among the strategies outside the learned family, chosen as the
answer chooses; each learned aggregator is compared with it as the answer compares strategies (compare_strategies:
chosen on CV, Wilcoxon signed-rank with Holm, Bayesian signed-rank with the ROPE): `ahead` when the held-out test
separates it above the card's best, `behind` when below, else `practically equivalent` or `not separated`.
"""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.prober.auroc import ProbeError
from poolbench.prober.verdicts import DEFAULT_ROPE, choose_on_cv, compare_strategies
from poolbench.records.verdicts import BETTER, EQUIVALENT, NOT_SEPARATED, WORSE
from poolbench.results.answer.axes import change_interval, interval_text, mean_interval

LEARNED_FAMILY = "learned_aggregation"
CURVE_FILE = "learning_curve.json"


def _reading(learned_is_best: bool, verdict: str) -> str:
    """The learned aggregator against the card's best, whichever of the two CV chose."""
    if verdict == EQUIVALENT:
        return "practically equivalent"
    if verdict == NOT_SEPARATED:
        return "not separated"
    ahead = (verdict == WORSE) if learned_is_best else (verdict == BETTER)
    return "ahead" if ahead else "behind"


def _point(label: int | None, results: dict, leaderboard: dict, rope: float, n_bootstrap: int, seed: int) -> dict:
    rows = {r["strategy"]: r for r in leaderboard.get("strategies") or []}
    n_train = sorted({int(c["n_train"]) for c in results.get("cells") or [] if c.get("n_train") is not None})
    card = {s: r for s, r in rows.items() if r.get("family") != LEARNED_FAMILY}
    card_best = choose_on_cv({s: r["mean_cv_auroc"] for s, r in card.items()}) if card else None
    point: dict = {"train_limit": label, "n_train": n_train, "card_best": card_best,
                   "strategies": {s: {**mean_interval([v["auroc"] for v in r["per_concept"].values()]),
                                      "layer": r["best_layer"], "family": r.get("family")} for s, r in rows.items()},
                   "learned": {}}
    for s, r in rows.items():
        if r.get("family") != LEARNED_FAMILY or card_best is None:
            continue
        b = rows[card_best]
        concepts = sorted(set(r["per_concept"]) & set(b["per_concept"]))
        entry: dict = {"difference": change_interval(
            [r["per_concept"][c]["auroc"] - b["per_concept"][c]["auroc"] for c in concepts])}
        try:
            v = compare_strategies(
                {x: {c: rows[x]["per_concept"][c]["auroc"] for c in concepts} for x in (s, card_best)},
                {x: {c: rows[x]["per_concept"][c]["cv_auroc"] for c in concepts} for x in (s, card_best)},
                {x: int(rows[x]["best_layer"]) for x in (s, card_best)}, rope=rope, n_bootstrap=n_bootstrap,
                seed=seed)
            [c] = v.comparisons
            entry |= {"reading": _reading(v.best.strategy == s, c.verdict), "test": c.test, "holm_p": c.holm_p,
                      "p_rope": c.p_rope}
        except ProbeError as exc:
            entry |= {"reading": "n/a", "test": str(exc).removeprefix("compare_strategies: ")}
        point["learned"][s] = entry
    return point


def learning_curve(points: Sequence[tuple[int | None, dict, dict]], *, rope: float = DEFAULT_ROPE,
                   n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """The curve from (train limit or None for the whole train split, results.json, leaderboard.json) per size, in
    order of size; `overtakes` gives per learned aggregator the first size at which it is ahead of the card's best
    (None: at no size run)."""
    curve = [_point(label, results, board, rope, n_bootstrap, seed) for label, results, board in points]
    learned = sorted({s for p in curve for s in p["learned"]})
    overtakes = {s: next((p["n_train"] for p in curve if p["learned"].get(s, {}).get("reading") == "ahead"), None)
                 for s in learned}
    return {"rope": rope, "points": curve, "overtakes": overtakes,
            "reading": "card's best: CV-chosen among the non-learned strategies at each size; a learned aggregator "
                       "is ahead / behind it where Wilcoxon-Holm separates them on the held-out test, practically "
                       "equivalent where the ROPE posterior decides, else not separated"}


def _size(point: dict) -> str:
    n = point["n_train"]
    return "/".join(str(x) for x in n) if n else "?"


def curve_sentences(curve: dict) -> list[str]:
    """Per learned aggregator: from which training size it is ahead of the card's best, and its reading per size."""
    out = []
    for s, at in curve["overtakes"].items():
        steps = "; ".join(f"{_size(p)} train: {p['learned'][s]['reading']} of {p['card_best']} "
                          f"(Δ {interval_text(p['learned'][s]['difference'], signed=True)})"
                          for p in curve["points"] if s in p["learned"])
        head = f"ahead of the card's best from {'/'.join(map(str, at))} training passages per concept" if at else \
            "ahead of the card's best at no training size run"
        out.append(f"{s}: {head} ({steps}).")
    return out


def curve_table(curve: dict) -> list[str]:
    """Markdown rows: one per strategy, mean D1 [95% t-interval over concepts] at each training size."""
    strategies = list(dict.fromkeys(s for p in curve["points"] for s in p["strategies"]))
    head = ["strategy", *[f"{_size(p)} train" for p in curve["points"]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in strategies:
        lines.append("| " + " | ".join([s, *[interval_text(p["strategies"][s]) if s in p["strategies"] else "—"
                                              for p in curve["points"]]]) + " |")
    return lines
