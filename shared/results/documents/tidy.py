"""The leaderboard as tables a dataframe reads: a tidy long table (one value per row: strategy, layer, concept,
metric, value, low, high) and a short wide view (one row per strategy) beside it."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from poolbench.records.verdicts import StrategyVerdicts
from poolbench.results.answer.ranking import mean_t_interval

LONG_COLUMNS = ("strategy", "layer", "concept", "metric", "value", "low", "high")
WIDE_COLUMNS = ("rank", "strategy", "family", "layer", "mean_d1", "low", "high", "d1_mix", "d1_mix_low",
                "d1_mix_high", "mean_cv_auroc", "verdict",
                "in_confidence_set", "win_rate", "average_rank", "worst_concept", "worst_d1")
CHOSEN = "chosen best"  # the verdict column of the strategy chosen on CV
# Per D1 cell of the leaderboard's probe: the metric and, where the cell has one, its interval's keys.
CELL_METRICS = (("test_auroc", "ci_low", "ci_high"), ("cv_auroc", None, None), ("seed_std", None, None),
                ("selectivity", None, None), ("mdl_compression", None, None), ("fallback_rate", None, None))
LEXICAL = "lexical_baseline"


def long_rows(results: dict, leaderboard: dict) -> list[dict]:
    """Every D1 cell's metrics at every layer, each strategy's mean test AUROC over concepts per layer (concept
    empty, t-interval over concepts) and the lexical baseline per concept (layer empty)."""
    probe = leaderboard.get("probe", "logistic")
    cells = sorted((c for c in results.get("cells") or [] if c.get("probe") == probe),
                   key=lambda c: (c["strategy"], int(c["layer"]), c["concept"]))
    rows: list[dict] = []
    by_strategy_layer: dict[tuple[str, int], list[float]] = {}
    for c in cells:
        for metric, low, high in CELL_METRICS:
            if c.get(metric) is None:
                continue
            rows.append({"strategy": c["strategy"], "layer": int(c["layer"]), "concept": c["concept"],
                         "metric": metric, "value": c[metric], "low": c.get(low) if low else None,
                         "high": c.get(high) if high else None})
        if c.get("test_auroc") is not None:
            by_strategy_layer.setdefault((c["strategy"], int(c["layer"])), []).append(float(c["test_auroc"]))
    for (strategy, layer), values in sorted(by_strategy_layer.items()):
        mean, low, high = mean_t_interval(values)
        rows.append({"strategy": strategy, "layer": layer, "concept": None, "metric": "mean_test_auroc",
                     "value": mean, "low": low, "high": high})
    for r in sorted(results.get("lexical_baseline") or [], key=lambda r: r["concept"]):
        rows.append({"strategy": LEXICAL, "layer": None, "concept": r["concept"], "metric": "test_auroc",
                     "value": r["test_auroc"], "low": r.get("ci_low"), "high": r.get("ci_high")})
    return rows


def wide_rows(leaderboard: dict, verdicts: StrategyVerdicts | None = None) -> list[dict]:
    """One row per strategy at its CV-chosen layer, in the leaderboard's order: mean D1 with its interval, D1_mix
    with its interval where the run is ranked on the tier estimand, mean CV AUROC, its verdict against
    the CV-chosen best (from the answer's verdicts, when given) and the worst concept."""
    by = {} if verdicts is None else {c.strategy: c for c in verdicts.comparisons}
    best = None if verdicts is None else verdicts.best.strategy
    in_set = set() if verdicts is None else set(verdicts.confidence_set)
    rows = []
    for r in sorted(leaderboard.get("strategies") or [], key=lambda r: r["rank"]):
        mean, low, high = mean_t_interval([v["auroc"] for v in r["per_concept"].values()])
        worst, worst_v = min(r["per_concept"].items(), key=lambda kv: kv[1]["auroc"])
        s = r["strategy"]
        rows.append({"rank": r["rank"], "strategy": s, "family": r.get("family"),
                     "layer": r["best_layer"], "mean_d1": mean, "low": low, "high": high,
                     "d1_mix": r.get("d1_mix"), "d1_mix_low": r.get("d1_mix_ci_low"),
                     "d1_mix_high": r.get("d1_mix_ci_high"),
                     "mean_cv_auroc": r.get("mean_cv_auroc"),
                     "verdict": CHOSEN if s == best else by[s].verdict if s in by else None,
                     "in_confidence_set": (s in in_set) if verdicts is not None else None,
                     "win_rate": r.get("win_rate"), "average_rank": r.get("average_rank"),
                     "worst_concept": worst, "worst_d1": worst_v["auroc"]})
    return rows


def to_csv(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """CSV text with empty fields for missing values and full float precision (a reader rounds, not the file)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return buffer.getvalue()
