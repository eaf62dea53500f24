"""The leaderboard a run prints, and its one-line summary: a reader sees intervals and each strategy's verdict
against the best chosen on CV (from the run's answer), not just an order."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from poolbench.records.d1 import cv_best_row
from poolbench.results.answer.leaderboard import RANKED_ON_MIX, ranked_on_text
from poolbench.results.answer.ranking import mean_t_interval

if TYPE_CHECKING:
    from poolbench.results.answer.answer import RunAnswer

CHOSEN = "chosen best"


def _interval(mean: float, low: float | None, high: float | None) -> str:
    return f"{mean:.3f}" if low is None or high is None else f"{mean:.3f} [{low:.3f}, {high:.3f}]"


def verdict_of(answer: RunAnswer | None) -> dict[str, str]:
    """Strategy -> its verdict against the CV-chosen best, as the run's answer holds it; empty without verdicts."""
    if answer is None or answer.verdicts is None:
        return {}
    return {c.strategy: c.verdict for c in answer.verdicts.comparisons} | {answer.verdicts.best.strategy: CHOSEN}


def leaderboard_caption(answer: RunAnswer | None, leaderboard: dict | None = None) -> str:
    """What the order, the intervals and the verdicts are, printed under the table."""
    ci = (f"{ranked_on_text(leaderboard or {})}; mean D1: held-out AUROC averaged over concepts; intervals: 95% "
          "Student-t over the concepts")
    if answer is None or answer.verdicts is None:
        return f"{ci}; no verdicts ({'no answer' if answer is None else answer.verdicts_missing})."
    v = answer.verdicts
    return (f"{ci}; the best is chosen on mean CV AUROC; verdict: against it, Wilcoxon signed-rank over concepts "
            f"with Holm's step-down (α = {v.alpha}) or the Bayesian signed-rank test with a ±{v.rope:g} ROPE; worst "
            "concept: its held-out AUROC with its 95% CI.")


def leaderboard_table(leaderboard: dict, answer: RunAnswer | None = None) -> Table:
    """Per strategy: D1_mix with its CI where the run is ranked on it, mean D1 with its CI, mean CV, chosen layer,
    verdict, worst concept with its CI."""
    verdicts = verdict_of(answer)
    rows = sorted(leaderboard["strategies"], key=lambda r: r["rank"])
    mix = leaderboard.get("ranked_on") == RANKED_ON_MIX
    on = "D1_mix, the declared tier estimand" if mix else "held-out AUROC"
    if leaderboard.get("estimand_missing"):
        on += ", not the declared D1_mix (see below)"
    table = Table(title=f"D1 leaderboard ({leaderboard['probe']} probe, ranked on {on} at the CV-chosen layer)",
                  caption=leaderboard_caption(answer, leaderboard), caption_justify="left")
    for column in ("rank", "strategy", *(["D1_mix [95% CI]"] if mix else []), "mean D1 [95% CI]", "mean CV", "layer",
                   "verdict", "worst concept [95% CI]", ">50% fallback"):
        table.add_column(column, justify="right" if column in ("rank", "mean CV", "layer") else "left")
    for row in rows:
        strategy = row["strategy"]
        worst_name, worst = min(row["per_concept"].items(), key=lambda kv: kv[1]["auroc"])
        table.add_row(
            str(row["rank"]), strategy,
            *([_interval(row["d1_mix"], row.get("d1_mix_ci_low"), row.get("d1_mix_ci_high"))] if mix else []),
            _interval(*mean_t_interval([v["auroc"] for v in row["per_concept"].values()])),
            f"{row['mean_cv_auroc']:.3f}", str(row["best_layer"]), verdicts.get(strategy, "-"),
            f"{worst_name} {_interval(worst['auroc'], worst.get('ci_low'), worst.get('ci_high'))}",
            ", ".join(row["fallback_flagged_concepts"]) or "-")
    return table


def summary_line(leaderboard: dict, *, total_s: float, results_path: Path, answer: RunAnswer | None = None) -> str:
    """One sentence a person reads last: the best strategy (chosen on CV), its layer and held-out D1, the size of
    the confidence set for the best, how much was run, how long, where."""
    rows = sorted(leaderboard["strategies"], key=lambda r: r["rank"])
    if not rows:
        return f"no D1 cells; {_duration(total_s)}; results in {results_path}"
    chosen = answer.best.strategy if answer is not None and answer.best is not None else cv_best_row(rows)[
        "strategy"]
    top = next(r for r in rows if r["strategy"] == chosen)
    n_concepts = len(top["per_concept"])
    mean, low, high = mean_t_interval([v["auroc"] for v in top["per_concept"].values()])
    in_set = "" if answer is None or answer.verdicts is None else (
        f", one of {len(answer.verdicts.confidence_set)} in the confidence set for the best")
    return (f"best (chosen on CV): {top['strategy']} at layer {top['best_layer']}, D1 {_interval(mean, low, high)}"
            f"{in_set}; {len(rows)} strategies x {n_concepts} concept{'s' if n_concepts != 1 else ''} in "
            f"{_duration(total_s)}; results in {results_path}")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
