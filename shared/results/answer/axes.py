"""The run's cell axes beside layers in results.json, leaderboard.json and the answer: D1 by activation site (which
site wins, with the answer's verdicts) and D1 by context length (which strategies keep D1 as contexts grow).

Each site is read the way the run reads strategies: per site every strategy's layer is chosen on training CV,
the site's best strategy is its CV-chosen best, and the sites' bests are compared as the answer compares strategies
(prober.verdicts.compare_strategies: chosen on CV, Wilcoxon-Holm, Bayesian signed-rank with the ROPE). A length
reads each strategy at the layer the main leaderboard chose (training is at length 1 at every length, so CV is too).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from poolbench.config import RESIDUAL_SITE as RESIDUAL
from poolbench.prober.auroc import ProbeError
from poolbench.prober.verdicts import DEFAULT_ROPE, compare_strategies
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.answer_verdicts import p_text
from poolbench.results.answer.leaderboard import PRIMARY_PROBE, build_leaderboard
from poolbench.results.answer.ranking import mean_t_interval

STEERING_NOTE = ("Cells at the attn and mlp sites are not steered: both steering backends add at the block output "
                 "(layers.L.out), so D2/D3 are the residual site's only.")


def results_section(sites: Sequence[str], lengths: Sequence[int], records: Sequence[D1CellRecord],
                    artifacts: dict) -> dict:
    """results.json's `axes`: the sites and lengths run and every cell beside the main ones, each with its site and
    context length; absent on a run without the axes."""
    if not records:
        return {}
    return {"axes": {"sites": list(sites), "context_lengths": list(lengths),
                     "cells": [r.to_dict() for r in records], "artifacts": artifacts,
                     **({"steering": STEERING_NOTE} if any(s != RESIDUAL for s in sites) else {})}}


def mean_interval(values: Sequence[float]) -> dict:
    mean, low, high = mean_t_interval(values)
    return {"mean": mean, "low": low, "high": high, "n": len(values)}


def change_interval(values: Sequence[float]) -> dict:
    """Mean per-concept change with a Student-t interval over concepts (not clipped: a change may be negative)."""
    mean, low, high = mean_t_interval(values, clip=False)
    return {"mean": mean, "low": low, "high": high, "n": len(values)}


def site_section(main: Sequence[D1CellRecord], others: Sequence[D1CellRecord], *, rope: float = DEFAULT_ROPE,
                 n_bootstrap: int = 1000, seed: int = 0) -> dict:
    """leaderboard.json's `sites`: per site each strategy's mean D1 at its CV-chosen layer, each site's CV-chosen
    best, and the sites' bests compared with the answer's verdicts (empty with one site)."""
    by_site: dict[str, list[D1CellRecord]] = defaultdict(list)
    by_site[RESIDUAL] = list(main)
    for record in others:
        if record.site not in (None, RESIDUAL) and (record.context_length or 1) == 1:
            by_site[str(record.site)].append(record)
    if len(by_site) < 2:
        return {}
    table, best = {}, {}
    for site, records in by_site.items():
        board = build_leaderboard(records)
        rows = board["strategies"]
        table[site] = {r["strategy"]: {"layer": r["best_layer"], "mean_cv_auroc": r["mean_cv_auroc"],
                                       "d1": mean_interval([v["auroc"] for v in r["per_concept"].values()])}
                       for r in rows}
        if rows:
            row = next(r for r in rows if r["strategy"] == board["best_on_cv"])
            best[site] = {"strategy": row["strategy"], "layer": row["best_layer"],
                          "mean_cv_auroc": row["mean_cv_auroc"], "per_concept": row["per_concept"],
                          "d1": mean_interval([v["auroc"] for v in row["per_concept"].values()])}
    verdicts, missing = None, None
    try:
        verdicts = compare_strategies(
            {s: {c: v["auroc"] for c, v in b["per_concept"].items()} for s, b in best.items()},
            {s: {c: v["cv_auroc"] for c, v in b["per_concept"].items()} for s, b in best.items()},
            {s: int(b["layer"]) for s, b in best.items()}, rope=rope, n_bootstrap=n_bootstrap or 1000, seed=seed)
    except ProbeError as exc:
        missing = str(exc).removeprefix("compare_strategies: ")
    return {"sites": {"sites": list(by_site), "by_site": table,
                      "best_by_site": {s: {k: v for k, v in b.items() if k != "per_concept"} for s, b in best.items()},
                      "best_on_cv": verdicts.best.strategy if verdicts is not None else None,
                      "verdicts": _verdicts_dict(verdicts), "verdicts_missing": missing, "steering": STEERING_NOTE}}


def _verdicts_dict(verdicts: object) -> dict | None:
    if verdicts is None:
        return None
    from pydantic import TypeAdapter

    return TypeAdapter(type(verdicts)).dump_python(verdicts, mode="json")


def length_section(main: Sequence[D1CellRecord], others: Sequence[D1CellRecord], *, rope: float = DEFAULT_ROPE
                   ) -> dict:
    """leaderboard.json's `context_lengths`: per strategy, at the layer the main leaderboard chose, D1 at each
    length and its change from length 1 over concepts (t-interval); a strategy `loses` D1 at k where the interval
    lies below 0, `keeps` it where it lies above -rope, else `undecided` (n/a below three concepts)."""
    lengths = sorted({int(r.context_length) for r in others if r.context_length and r.context_length > 1
                      and r.site in (None, RESIDUAL)})
    if not lengths:
        return {}
    board = build_leaderboard(main)
    cells: dict[tuple[int, str, int], dict[str, float]] = defaultdict(dict)
    for record in [*main, *others]:
        if record.probe == PRIMARY_PROBE and record.site in (None, RESIDUAL):
            cells[(record.context_length or 1, record.strategy, record.layer)][record.concept] = float(
                record.test_auroc)
    by_strategy = {}
    for row in board["strategies"]:
        strategy, layer = row["strategy"], int(row["best_layer"])
        base = cells[(1, strategy, layer)]
        entry: dict = {"layer": layer, "d1": {"1": mean_interval(list(base.values()))}, "change": {}, "reading": {}}
        for k in lengths:
            at = cells.get((k, strategy, layer), {})
            concepts = sorted(set(base) & set(at))
            if not concepts:
                continue
            change = change_interval([at[c] - base[c] for c in concepts])
            entry["d1"][str(k)] = mean_interval([at[c] for c in concepts])
            entry["change"][str(k)] = change
            entry["reading"][str(k)] = ("n/a" if change["low"] is None else "loses" if change["high"] < 0
                                        else "keeps" if change["low"] > -rope else "undecided")
        by_strategy[strategy] = entry
    return {"context_lengths": {"lengths": [1, *lengths], "rope": rope, "by_strategy": by_strategy,
                                "reading": "loses: the t-interval over concepts of D1(k) - D1(1) lies below 0; keeps: "
                                           "it lies above -rope; undecided: neither"}}


def interval_text(d: dict, signed: bool = False) -> str:
    fmt = "+.3f" if signed else ".3f"
    text = format(d["mean"], fmt)
    return text + ("" if d["low"] is None else f" [{format(d['low'], fmt)}, {format(d['high'], fmt)}]")


def site_sentences(section: dict) -> list[str]:
    """The answer's words on the sites: the best site chosen on CV, its held-out D1, each other site's verdict."""
    best, v = section["best_by_site"], section.get("verdicts")
    if v is None:
        named = ", ".join(f"{s}: {b['strategy']} L{b['layer']} D1 {interval_text(b['d1'])}" for s, b in best.items())
        return [f"Activation sites ({named}); not compared: {section.get('verdicts_missing')}.", STEERING_NOTE]
    site = v["best"]["strategy"]
    b = best[site]
    out = [f"Best activation site, chosen on the training CV: {site} ({b['strategy']} at layer {b['layer']}, mean CV "
           f"AUROC {b['mean_cv_auroc']:.3f}; held-out mean D1 {interval_text(b['d1'])} over {b['d1']['n']} "
           f"concepts); the held-out test "
           f"{'confirms it' if v['best']['confirmation'] == 'confirmed' else 'does not confirm it'}."]
    for c in v["comparisons"]:
        o = best[c["strategy"]]
        out.append(f"Site {c['strategy']} ({o['strategy']} L{o['layer']}, D1 {interval_text(o['d1'])}): {c['verdict']} "
                   f"({c['test']}; best minus it {c['mean_difference']:+.3f}, Holm p {p_text(c['holm_p'])}, "
                   f"P(ROPE) {c['p_rope']:.3f}).")
    return [*out, STEERING_NOTE]


def length_sentences(section: dict) -> list[str]:
    """The answer's words on the length axis: per length, which strategies lose D1, keep it or stay undecided."""
    out = ["Context length: each test passage also read inside k x its length of neutral text, probes trained at "
           "length 1, each strategy at its chosen layer; change of D1 from length 1, mean over concepts "
           "[95% t-interval]."]
    rows = section["by_strategy"]
    for k in section["lengths"][1:]:
        words = []
        for reading in ("loses", "keeps", "undecided", "n/a"):
            named = [f"{s} {interval_text(e['change'][str(k)], signed=True)}" for s, e in rows.items()
                     if e["reading"].get(str(k)) == reading]
            if named:
                words.append(f"{reading}: " + ", ".join(named))
        out.append(f"At {k}x: " + "; ".join(words) + ".")
    return out


def answer_sections(leaderboard: dict) -> list:
    """The answer's parts for the axes, read from leaderboard.json's `sites` and `context_lengths`."""
    from poolbench.results.answer.answer import AnswerSection

    out = []
    if sites := leaderboard.get("sites"):
        verdicts = sites.get("verdicts") or {}
        out.append(AnswerSection("sites", "Activation sites", tuple(site_sentences(sites)), {
            "best_site": sites.get("best_on_cv"),
            **{f"{s}_d1": b["d1"]["mean"] for s, b in sites["best_by_site"].items()},
            **{f"{c['strategy']}_verdict": c["verdict"] for c in verdicts.get("comparisons", [])}}))
    if lengths := leaderboard.get("context_lengths"):
        out.append(AnswerSection("context_lengths", "Context length", tuple(length_sentences(lengths)), {
            f"{s}_k{k}": reading for s, e in lengths["by_strategy"].items() for k, reading in e["reading"].items()}))
    return out


def axes_html(leaderboard: dict) -> str:
    """The report's tables: mean D1 per strategy and site, and per strategy and context length (with the change)."""
    import html

    parts = []
    if sites := leaderboard.get("sites"):
        names = sites["sites"]
        strategies = sorted({s for table in sites["by_site"].values() for s in table})
        rows = "".join("<tr><td>" + html.escape(s) + "</td>" + "".join(
            f"<td>{interval_text(sites['by_site'][n][s]['d1'])} (L{sites['by_site'][n][s]['layer']})</td>"
            if s in sites["by_site"][n] else "<td>—</td>" for n in names) + "</tr>" for s in strategies)
        parts.append('<table class="sites"><thead><tr><th>strategy</th>' + "".join(
            f"<th>{html.escape(n)}</th>" for n in names) + f"</tr></thead><tbody>{rows}</tbody></table>")
    if lengths := leaderboard.get("context_lengths"):
        ks = [str(k) for k in lengths["lengths"]]
        rows = "".join("<tr><td>" + html.escape(s) + f"</td><td>{e['layer']}</td>" + "".join(
            f"<td>{interval_text(e['d1'][k])}</td>" if k in e["d1"] else "<td>—</td>" for k in ks) + "".join(
            f"<td>{interval_text(e['change'][k], signed=True)} {e['reading'][k]}</td>" if k in e["change"]
            else "<td>—</td>" for k in ks[1:]) + "</tr>" for s, e in lengths["by_strategy"].items())
        parts.append('<table class="lengths"><thead><tr><th>strategy</th><th>layer</th>' + "".join(
            f"<th>D1 at {k}x</th>" for k in ks) + "".join(f"<th>change at {k}x</th>" for k in ks[1:])
            + f"</tr></thead><tbody>{rows}</tbody></table>")
    return "".join(parts)
