"""The cross-model table: strategy × model mean D1 at each model's CV-chosen layer, ranks per model, mean rank,
Kendall's W across models, and the answer in words ("best in every model", "best on average", equal means said as
such; within a model, what its own answer's verdicts separate)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from poolbench.errors import PoolBenchError
from poolbench.prober.concordance import concordance
from poolbench.records.verdicts import WORSE
from poolbench.results.answer.ranking import mean_t_interval

CROSS_MODEL_VERSION = 1


@dataclass(frozen=True)
class ModelBoard:
    """One model's finished leaderboard, the name the run was given for it and its depth."""

    name: str
    model_id: str
    n_layers: int
    leaderboard: dict
    folder: str = ""
    chosen: str | None = None  # the model's best chosen on CV (its answer.json); None without an answer
    verdicts: Mapping[str, str] | None = None  # each other strategy's verdict against `chosen`, from its answer


def relative_depth(layer: int, n_layers: int) -> float:
    """layer / (n_layers − 1): 0 is the first block, 1 the last, so a 30- and an 18-layer model overlay."""
    return 0.0 if n_layers <= 1 else layer / (n_layers - 1)


def shared_cells(boards: Sequence[ModelBoard]) -> tuple[list[str], list[str]]:
    """Strategies every model ranked and concepts every model's every such strategy has, in first-board order:
    W compares like with like, so a strategy or concept missing from one model leaves the table."""
    rows = [{r["strategy"]: r for r in b.leaderboard.get("strategies", [])} for b in boards]
    strategies = [s for s in rows[0] if all(s in r for r in rows[1:])]
    if len(strategies) < 2:
        raise PoolBenchError(f"cross-model table: the models share {len(strategies)} ranked strategies; it needs 2")
    first = rows[0][strategies[0]]["per_concept"]
    concepts = [c for c in first if all(c in r[s]["per_concept"] for r in rows for s in strategies)]
    if not concepts:
        raise PoolBenchError("cross-model table: the models share no probed concept")
    return strategies, concepts


def _best(values: Mapping[str, float], higher: bool) -> list[str]:
    """Every strategy at the extreme: a tie is named as a tie, never broken by name order."""
    extreme = max(values.values()) if higher else min(values.values())
    return sorted(s for s, v in values.items() if v == extreme)


def not_separated_from_best(board: ModelBoard) -> list[str] | None:
    """Strategies the model's own answer does not find worse than its CV-chosen best (not separated, practically
    equivalent, or ahead of it); None when the model's folder holds no answer with verdicts."""
    if board.chosen is None or board.verdicts is None:
        return None
    return sorted(s for s, verdict in board.verdicts.items() if verdict != WORSE)


def cross_model_table(boards: Sequence[ModelBoard], *, n_permutations: int = 9999, n_bootstrap: int = 1000,
                      seed: int = 0) -> dict:
    """The table every cross-model view reads: rows per strategy with each model's D1 (mean over the shared
    concepts, t-interval over concepts), chosen layer and its relative depth, rank within the model; the
    agreement statistic; and who is best where."""
    if len(boards) < 2:
        raise PoolBenchError(f"cross-model table: needs at least two models, got {len(boards)}")
    strategies, concepts = shared_cells(boards)
    by_model = [{r["strategy"]: r for r in b.leaderboard["strategies"]} for b in boards]
    d1 = np.array([[[rows[s]["per_concept"][c]["auroc"] for c in concepts] for s in strategies]
                   for rows in by_model], dtype=np.float64)  # [models, strategies, concepts]
    means = d1.mean(axis=-1)
    ranks = rankdata(-means, method="average", axis=-1)
    mean_rank = ranks.mean(axis=0)
    names = [b.name for b in boards]
    rows = []
    for j, strategy in enumerate(strategies):
        per_model = {}
        for i, board in enumerate(boards):
            row = by_model[i][strategy]
            mean, low, high = mean_t_interval(d1[i, j])
            steering = (board.leaderboard.get("steering") or {}).get(strategy)
            per_model[board.name] = {
                "mean_d1": mean, "ci_low": low, "ci_high": high, "rank": float(ranks[i, j]),
                "best_layer": int(row["best_layer"]), "n_layers": board.n_layers,
                "relative_depth": relative_depth(int(row["best_layer"]), board.n_layers),
                "layer_near_tie": row.get("layer_near_tie"),
                "layer_curve": {f"{relative_depth(int(L), board.n_layers):.4f}": float(v)
                                for L, v in sorted(row["layer_curve"].items(), key=lambda kv: int(kv[0]))},
                **({"mean_d2_delta": steering.get("mean_d2_delta"), "mean_scp": steering.get("mean_scp")}
                   if steering else {}),
            }
        family = next((r[strategy].get("family") for r in by_model if r[strategy].get("family")), None)
        rows.append({"strategy": strategy, **({"family": family} if family else {}),
                     "mean_rank": float(mean_rank[j]), "mean_d1": float(means[:, j].mean()), "per_model": per_model})
    rows.sort(key=lambda r: (r["mean_rank"], -r["mean_d1"], r["strategy"]))
    best_per_model = {name: _best(dict(zip(strategies, means[i].tolist(), strict=True)), higher=True)
                      for i, name in enumerate(names)}
    in_every = sorted(set.intersection(*(set(v) for v in best_per_model.values())))
    on_average = _best(dict(zip(strategies, mean_rank.tolist(), strict=True)), higher=False)
    agreement = concordance(d1, n_permutations=n_permutations, n_bootstrap=n_bootstrap, seed=seed).to_dict()
    within = {b.name: not_separated_from_best(b) for b in boards}
    table = {
        "version": CROSS_MODEL_VERSION,
        "models": [{"name": b.name, "model_id": b.model_id, "n_layers": b.n_layers, "folder": b.folder}
                   for b in boards],
        "concepts": concepts, "strategies": [r["strategy"] for r in rows], "rows": rows,
        "agreement": agreement,
        "best": {"per_model": best_per_model, "in_every_model": in_every, "on_average": on_average,
                 "on_average_mean_rank": float(mean_rank.min()),
                 "chosen_on_cv": {b.name: b.chosen for b in boards if b.chosen is not None},
                 "not_separated_within_model": {k: v for k, v in within.items() if v is not None}},
        "d1": "held-out AUROC at each model's own CV-chosen layer per strategy, mean over the concepts every "
              "model probed; rank 1 = highest mean D1 in that model, equal means share the average rank",
    }
    table["answer"] = cross_model_sentences(table)
    return table


def model_cell_text(cell: Mapping, sep: str = " ") -> str:
    """One (strategy, model) cell as both pages print it: mean D1 [interval], rank, layer (relative depth), and
    the runner-up layer where the layer choice is a near-tie (near_ties.layer_near_tie)."""
    interval = "" if cell["ci_low"] is None else f" [{cell['ci_low']:.3f}, {cell['ci_high']:.3f}]"
    tie = cell.get("layer_near_tie")
    near = "" if not tie else f" (near-tie: L{int(tie['runner_up'])})"
    return sep.join([f"{cell['mean_d1']:.3f}{interval}", f"#{cell['rank']:g}",
                     f"L{cell['best_layer']} ({cell['relative_depth']:.2f}){near}"])


def _list(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _interval(low: float | None, high: float | None) -> str:
    return "no interval" if low is None or high is None else f"[{low:.2f}, {high:.2f}]"


def cross_model_sentences(table: dict) -> list[str]:
    """The cross-model answer in plain sentences: who is best in each model and in all, who is best on average,
    and how much the rankings agree (W, its interval and p)."""
    best = table["best"]
    models = [m["name"] for m in table["models"]]
    labels = {m["name"]: m["name"] if m["name"] == m["model_id"] else f"{m['name']} ({m['model_id']})"
              for m in table["models"]}
    rows = {r["strategy"]: r for r in table["rows"]}
    lines = []
    every = best["in_every_model"]
    if len(every) == 1 and all(v == every for v in best["per_model"].values()):
        lines.append(f"{every[0]} is the best strategy in every model ({_list([labels[m] for m in models])}).")
    elif every:
        lines.append(f"{_list(every)} {'is' if len(every) == 1 else 'are'} best in every model, with equal means: "
                     + "; ".join(f"on {labels[m]} {_list(best['per_model'][m])}" for m in models
                                 if len(best['per_model'][m]) > 1) + ".")
    else:
        lines.append("No strategy is best in every model: " + "; ".join(
            f"best on {labels[m]} is {_list(best['per_model'][m])}"
            + (" (equal means)" if len(best['per_model'][m]) > 1 else "")
            + f" (D1 {rows[best['per_model'][m][0]]['per_model'][m]['mean_d1']:.3f})" for m in models) + ".")
    lines.extend(first_best_elsewhere(table, labels))
    within = best.get("not_separated_within_model") or {}
    if any(within.values()):
        chosen = best.get("chosen_on_cv") or {}
        counts = {m: len(within[m]) for m in models if m in within}
        lines.append("Within each model, its best chosen on CV is not separated (Wilcoxon-Holm or the ROPE, its own "
                     "answer) from: " + "; ".join(
                         f"on {labels[m]} {n} other strateg{'y' if n == 1 else 'ies'} (best {chosen.get(m, '?')})"
                         for m, n in counts.items()) + ".")
    average = best["on_average"]
    lines.append(f"Best on average over {len(models)} models: {_list(average)}"
                 + (" (equal mean ranks)" if len(average) > 1 else "")
                 + f", mean rank {best['on_average_mean_rank']:.1f} of {len(table['strategies'])}.")
    a = table["agreement"]
    strength = ("strong" if a["kendall_w"] >= 0.7 else "moderate" if a["kendall_w"] >= 0.4 else "weak")
    lines.append(f"Rank agreement across models: Kendall's W = {a['kendall_w']:.2f}, 95% interval "
                 f"{_interval(a['ci_low'], a['ci_high'])} over concepts, permutation p = {a['p_value']:.3g} "
                 f"({strength}; {a['n_strategies']} strategies, {a['n_concepts']} concepts).")
    return lines


def first_best_elsewhere(table: dict, labels: Mapping[str, str]) -> list[str]:
    """Where the first model's best strategy stands in each other model: its rank and D1 against that model's best,
    and its verdict in that model's own answer (the question "does the winner carry over")."""
    best, models = table["best"], [m["name"] for m in table["models"]]
    first, others = models[0], models[1:]
    if len(best["per_model"][first]) != 1:  # winners with equal means: no single strategy to follow
        return []
    [winner] = best["per_model"][first]
    cells = {r["strategy"]: r["per_model"] for r in table["rows"]}
    lines = []
    for m in others:
        if winner in best["per_model"][m]:
            tie = f", with the same mean as {_list([s for s in best['per_model'][m] if s != winner])}" \
                if len(best["per_model"][m]) > 1 else ""
            lines.append(f"{labels[first]}'s best, {winner}, is also best on {labels[m]}{tie}.")
            continue
        top = best["per_model"][m][0]
        within = (best.get("not_separated_within_model") or {}).get(m)
        chosen = (best.get("chosen_on_cv") or {}).get(m)
        verdict = ("no verdict (that model's folder holds no answer)" if within is None or chosen is None
                   else "it is that model's best chosen on CV" if winner == chosen
                   else f"not separated from that model's CV-chosen best, {chosen}, in its answer" if winner in within
                   else f"worse than that model's CV-chosen best, {chosen}, in its answer")
        lines.append(f"{labels[first]}'s best, {winner}, is not best on {labels[m]}: rank "
                     f"{cells[winner][m]['rank']:g} of {len(table['strategies'])}, D1 "
                     f"{cells[winner][m]['mean_d1']:.3f} against {top}'s {cells[top][m]['mean_d1']:.3f}; "
                     f"{verdict}.")
    return lines
