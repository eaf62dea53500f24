"""The leaderboard a run prints, and its one-line summary: a reader sees intervals and ties, not just an order."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from poolbench.results.ranking import group_letters, mean_t_interval, tie_groups

BEST_MARK = "*"


def _interval(mean: float, low: float | None, high: float | None) -> str:
    return f"{mean:.3f}" if low is None or high is None else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def tie_letters(leaderboard: dict) -> tuple[dict[str, str], float | None]:
    """Compact letters from the Nemenyi critical difference over the Friedman average ranks that results.json
    already holds (strategies sharing a letter are not separable), and the CD; empty without a Friedman test."""
    friedman = leaderboard.get("friedman") or {}
    ranks, cd = friedman.get("average_ranks"), friedman.get("critical_difference")
    if not ranks or cd is None:
        return {}, None
    return group_letters(tie_groups(ranks, float(cd))), float(cd)


def leaderboard_caption(leaderboard: dict, cd: float | None) -> str:
    """What the intervals and the tie letters are, printed under the table."""
    ci = "mean D1: held-out AUROC averaged over concepts, 95% Student-t interval over the concepts"
    if cd is None:
        return f"{ci}; no tie groups (no Friedman test: it needs at least two strategies and concepts)."
    alpha = (leaderboard.get("friedman") or {}).get("alpha", 0.05)
    return (f"{ci}; tie group: strategies sharing a letter have Friedman average ranks within the Nemenyi "
            f"critical difference (CD {cd:.2f} ranks, α = {alpha}) and are not told apart; {BEST_MARK} = tied "
            "with the best; worst concept: its held-out AUROC with the pair-bootstrap 95% CI.")


def leaderboard_table(leaderboard: dict) -> Table:
    """Per strategy: mean D1 with its CI, chosen layer, tie letters, worst concept with its bootstrap CI."""
    letters, cd = tie_letters(leaderboard)
    rows = sorted(leaderboard["strategies"], key=lambda r: r["rank"])
    best = set(letters.get(rows[0]["strategy"], "")) if rows else set()
    table = Table(title=f"D1 leaderboard ({leaderboard['probe']} probe, held-out AUROC at the CV-chosen layer)",
                  caption=leaderboard_caption(leaderboard, cd), caption_justify="left")
    for column in ("rank", "strategy", "mean D1 [95% CI]", "mean CV", "layer", "tie group", "worst concept [95% CI]",
                   ">50% fallback"):
        table.add_column(column, justify="right" if column in ("rank", "mean CV", "layer") else "left")
    for row in rows:
        strategy = row["strategy"]
        tied = row is not rows[0] and bool(best & set(letters.get(strategy, "")))
        worst_name, worst = min(row["per_concept"].items(), key=lambda kv: kv[1]["auroc"])
        table.add_row(
            str(row["rank"]), strategy, _interval(*mean_t_interval([v["auroc"] for v in row["per_concept"].values()])),
            f"{row['mean_cv_auroc']:.3f}", str(row["best_layer"]),
            (letters.get(strategy, "-") + (f" {BEST_MARK}" if tied else "")) if letters else "-",
            f"{worst_name} {_interval(worst['auroc'], worst.get('ci_low'), worst.get('ci_high'))}",
            ", ".join(row["fallback_flagged_concepts"]) or "-")
    return table


def summary_line(leaderboard: dict, *, total_s: float, results_path: Path) -> str:
    """One sentence a person reads last: the best strategy, its layer and D1, how much was run, how long, where."""
    rows = sorted(leaderboard["strategies"], key=lambda r: r["rank"])
    if not rows:
        return f"no D1 cells; {_duration(total_s)}; results in {results_path}"
    top = rows[0]
    n_concepts = len(top["per_concept"])
    mean, low, high = mean_t_interval([v["auroc"] for v in top["per_concept"].values()])
    letters, _ = tie_letters(leaderboard)
    best = set(letters.get(top["strategy"], ""))
    tied = [r["strategy"] for r in rows[1:] if best & set(letters.get(r["strategy"], ""))]
    ties = f", tied with {len(tied)} other{'s' if len(tied) != 1 else ''}" if letters else ""
    return (f"best: {top['strategy']} at layer {top['best_layer']}, D1 {_interval(mean, low, high)}{ties}; "
            f"{len(rows)} strategies x {n_concepts} concept{'s' if n_concepts != 1 else ''} in "
            f"{_duration(total_s)}; results in {results_path}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
