"""The report's tables and summaries as HTML strings: every number beside its interval ("0.912 [0.880, 0.944]"),
and rows a reader should not trust (a CI reaching 0.5, mostly fallback) marked by class."""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record, D3Record
from poolbench.results.answer.leaderboard import FALLBACK_FLAG_RATE, PRIMARY_PROBE, RANKED_ON_MIX
from poolbench.results.answer.near_ties import layer_text
from poolbench.results.answer.ranking import mean_t_interval
from poolbench.results.pages.report_runs import Run, friedman_of, primary_cells


def _num(value: object, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _ci(value: object, low: object, high: object, digits: int = 3) -> str:
    """A number with its interval, "0.912 [0.880, 0.944]"; the bare number when the run kept no interval."""
    if low is None or high is None:
        return _num(value, digits)
    return f"{_num(value, digits)} [{_num(low, digits)}, {_num(high, digits)}]"


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]], css: str = "", flags: Sequence[str] = ()) -> str:
    """An HTML table of already formatted strings; `flags[i]`, when given, is a class for row i."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join((f'<tr class="{flags[i]}">' if i < len(flags) and flags[i] else "<tr>")
                   + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for i, row in enumerate(rows))
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _mean_of(values: Sequence[float | int | None]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def leaderboard_table(run: Run) -> str:
    """Per strategy: mean D1 with its CI over concepts, win rate, average rank, its verdict against the CV-chosen
    best (from the run's answer) and the reliability columns (means over concepts at the chosen layer)."""
    cells = primary_cells(run)
    verdicts = None if run.answer is None else run.answer.verdicts
    letters = {} if verdicts is None else {c.strategy: c.verdict for c in verdicts.comparisons} | {
        verdicts.best.strategy: "chosen best"}
    on_mix = run.leaderboard.get("ranked_on") == RANKED_ON_MIX
    rows = []
    for r in sorted(run.leaderboard["strategies"], key=lambda r: r["rank"]):
        chosen = [cells.get((r["strategy"], int(r["best_layer"]), c)) for c in r["per_concept"]]
        chosen = [c for c in chosen if c is not None]
        mean, low, high = mean_t_interval([v["auroc"] for v in r["per_concept"].values()])
        mix = [_ci(r["d1_mix"], r.get("d1_mix_ci_low"), r.get("d1_mix_ci_high"))] if on_mix else []
        rows.append([str(r["rank"]), r["strategy"], r.get("family", "—"), *mix, _ci(mean, low, high),
                     _num(r["mean_cv_auroc"]), layer_text(r), _num(r.get("win_rate")),
                     _num(r.get("average_rank"), 2), letters.get(r["strategy"], "—"),
                     _num(_mean_of([c.seed_std for c in chosen]), 4), _num(_mean_of([c.selectivity for c in chosen])),
                     _num(_mean_of([c.mdl_compression for c in chosen]), 2),
                     ", ".join(r.get("fallback_flagged_concepts") or []) or "—"])
    columns = ("rank", "strategy", "family", *(["D1_mix [95% CI]"] if on_mix else []), "mean D1 [95% CI]", "mean CV",
               "layer", "win rate", "avg rank", "verdict", "seed σ", "selectivity", "MDL", ">50% fallback")
    return _table(columns, rows, "leaderboard")


def friedman_html(run: Run) -> str:
    friedman = friedman_of(run)
    if not friedman:
        reason = (run.results.get("reliability") or {}).get("skipped", "no Friedman test in results.json")
        return f'<p class="note">No Friedman test: {html.escape(reason)}.</p>'
    p = friedman.get("p_value")
    unit = (run.results.get("reliability") or {}).get("unit", "concept × layer")  # older runs blocked by cell
    return (f"<p>Friedman χ² = {_num(friedman.get('statistic'), 1)} over {friedman.get('n_units')} ({unit}) "
            f"blocks and k = {friedman.get('k')} strategies: <b>p = {'—' if p is None else f'{p:.3g}'}</b>; "
            f"Nemenyi critical difference CD = {_num(friedman.get('critical_difference'), 3)} at "
            f"α = {friedman.get('alpha', 0.05)}.</p>")


def d2_table(records: Sequence[D2Record]) -> str:
    rows, flags = [], []
    for r in sorted(records, key=lambda r: (r.concept, r.strategy, r.layer)):
        null = r.status == "null"
        rows.append([r.concept, r.strategy, str(r.layer), r.selected_because or "—",
                     f"null: {r.null_reason}" if null else "ok", _num(r.alpha_star, 3),
                     _ci(r.d2_delta, r.d2_delta_ci_low, r.d2_delta_ci_high), _ci(r.scp, r.scp_ci_low, r.scp_ci_high),
                     _num(r.fluency_ratio), _num(r.relevance),
                     _ci(r.prompted_delta, r.prompted_delta_ci_low, r.prompted_delta_ci_high),
                     str(r.n_prompts), _num(r.scorer_heldout_auroc)])
        flags.append("null" if null else "")
    columns = ("concept", "strategy", "layer", "chosen as", "status", "α*", "Δ(α*) [95% CI]", "SCP [95% CI]",
               "fluency ratio", "relevance", "prompted Δ [95% CI]", "prompts", "scorer AUROC")
    return _table(columns, rows, "d2", flags)


def d2_summary(records: Sequence[D2Record]) -> str:
    """The sentences a reader should not have to count out of the table."""
    ok = [r for r in records if r.status == "ok"]
    zero = sum(1 for r in ok if r.alpha_star == 0)
    excl = sum(1 for r in ok if r.d2_delta_ci_low is not None and (r.d2_delta_ci_low > 0 or r.d2_delta_ci_high < 0))
    scp = sum(1 for r in ok if r.scp_ci_low is not None and r.scp_ci_low > 0)
    return (f"<p>{len(records)} steering cells, {len(records) - len(ok)} with a null steering vector. α* = 0 (no "
            f"steering strength beat the unsteered text on the selection half) in <b>{zero} of {len(ok)}</b>; "
            f"Δ(α*)'s CI excludes 0 in <b>{excl} of {len(ok)}</b>; SCP's CI lies above 0 in "
            f"<b>{scp} of {len(ok)}</b>.</p>")


def d3_table(records: Sequence[D3Record]) -> str:
    rows, flags = [], []
    for r in sorted(records, key=lambda r: (r.concept, r.strategy, r.layer, r.relation)):
        disent = "null" if r.disent is None else _num(r.disent)
        if r.disent is not None and r.disent_raw is not None and r.disent_raw != r.disent:
            disent += f" (raw {_num(r.disent_raw)})"
        rows.append([r.concept, r.strategy, str(r.layer), f"{r.neighbour} ({r.relation})", _num(r.alpha_star),
                     _ci(r.delta_a, r.delta_a_ci_low, r.delta_a_ci_high),
                     _ci(r.delta_b, r.delta_b_ci_low, r.delta_b_ci_high), disent, _num(r.d3_rep),
                     r.disent_null_reason or r.neighbour_vector_null_reason or "—"])
        flags.append("null" if r.disent is None else "")
    columns = ("concept", "strategy", "layer", "neighbour", "α*", "Δ_A [95% CI]", "Δ_B [95% CI]", "Disent",
               "D3_rep", "why null")
    nulls = sum(1 for r in records if r.disent is None)
    return (f"<p>Disent is null in <b>{nulls} of {len(records)}</b> (concept, neighbour) records.</p>"
            + _table(columns, rows, "d3", flags))


def scorer_table(records: Sequence[ScorerValidity]) -> str:
    rows = [[r.concept, _ci(r.heldout_auroc, r.heldout_auroc_ci_low, r.heldout_auroc_ci_high),
             _num(r.heldout_accuracy), f"{_num(r.n_train)} / {_num(r.n_heldout)}", _num(r.min_auroc, 2),
             {True: "yes", False: "NO"}.get(r.valid, "—"), r.encoder or "—"]
            for r in sorted(records, key=lambda r: r.concept)]
    return _table(("concept", "held-out AUROC [95% CI]", "accuracy", "train / held-out", "bar", "valid", "encoder"),
                  rows, "scorers", ["null" if r[5] == "NO" else "" for r in rows])


def strategy_table(run: Run) -> str:
    specs = run.results.get("strategies") or []
    if not specs:
        return '<p class="note">results.json lists no strategy specs.</p>'
    rows = [[s["id"], s.get("family") or "—", s.get("supervision") or "—", ", ".join(s.get("needs") or []) or "—",
             s.get("description") or "—"] for s in specs]
    return _table(("id", "family", "supervision", "needs", "definition"), rows, "defs")


def per_concept_html(run: Run) -> str:
    """Per concept, every strategy's D1 with its CI at the strategy's chosen layer, with the cell's
    reliability columns; one collapsible block per concept, hardest concept first."""
    cells, lexical = primary_cells(run), {r.concept: r for r in run.lexical}
    by_concept: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for row in run.leaderboard["strategies"]:
        for concept, v in row["per_concept"].items():
            by_concept[concept].append((row, v))
    parts = []
    for concept in sorted(by_concept, key=lambda c: (np.median([v["auroc"] for _, v in by_concept[c]]), c)):
        entries = sorted(by_concept[concept], key=lambda e: -e[1]["auroc"])
        rows, flags = [], []
        for row, v in entries:
            c = cells.get((row["strategy"], int(row["best_layer"]), concept))
            seed = "—" if c is None or c.seed_mean is None else f"{c.seed_mean:.3f} ± {_num(c.seed_std, 4)}"
            rows.append([row["strategy"], str(row["best_layer"]), _ci(v["auroc"], v["ci_low"], v["ci_high"]),
                         _num(v["cv_auroc"]), seed, _num(None if c is None else c.selectivity),
                         _num(None if c is None else c.mdl_compression, 2), f"{100 * v.get('fallback_rate', 0):.0f}%"])
            flags.append("null" if v["ci_low"] <= 0.5 else ("flag" if v.get("fallback_rate", 0) > FALLBACK_FLAG_RATE
                                                             else ""))
        n = next((c for c in run.cells if c.concept == concept and c.probe == PRIMARY_PROBE), None)
        size = "" if n is None or n.n_train is None else f" · {n.n_train} train / {n.n_test} test passages"
        best = entries[0]
        lex = lexical.get(concept)
        lex_text = "" if lex is None else f" · lexical baseline {_ci(lex.test_auroc, lex.ci_low, lex.ci_high)}"
        parts.append(
            f"<details><summary><b>{html.escape(concept)}</b> — best {html.escape(best[0]['strategy'])} "
            f"{best[1]['auroc']:.3f}, median {np.median([v['auroc'] for _, v in entries]):.3f}{size}"
            f"{html.escape(lex_text)}</summary>"
            + _table(("strategy", "layer", "D1 [95% CI]", "CV", "seed mean ± σ", "selectivity", "MDL", "fallback"),
                     rows, "concept", flags) + "</details>")
    return "".join(parts)


def lexical_table(run: Run) -> str:
    """Per concept: the bag-of-words AUROC with its CI beside the best strategy's D1 and their difference."""
    best: dict[str, tuple[str, float]] = {}
    for row in run.leaderboard["strategies"]:
        for concept, v in row["per_concept"].items():
            if concept not in best or v["auroc"] > best[concept][1]:
                best[concept] = (row["strategy"], float(v["auroc"]))
    rows, flags = [], []
    for r in sorted(run.lexical, key=lambda r: (-float(r.test_auroc), r.concept)):
        strategy, d1 = best.get(r.concept, ("—", None))
        gap = None if d1 is None else d1 - float(r.test_auroc)
        rows.append([r.concept, _ci(r.test_auroc, r.ci_low, r.ci_high), f"{r.n_train} / {r.n_test}",
                     str(r.n_features), strategy, _num(d1), "—" if gap is None else f"{gap:+.3f}"])
        flags.append("flag" if float(r.ci_low) > 0.9 else "")
    saturated = sum(1 for r in run.lexical if float(r.ci_low) > 0.9)
    return (f"<p>The bag of words alone reaches a CI above 0.9 in <b>{saturated} of {len(run.lexical)}</b> "
            "concepts.</p>" + _table(("concept", "lexical AUROC [95% CI]", "train / test", "words", "best strategy",
                                      "its D1", "D1 − lexical"), rows, "lexical", flags))


def bucket_table(run: Run) -> str:
    """Every bucket's AUROC with its CI and how many test passages (and concepts) it rests on."""
    rows = [[r.strategy, str(r.layer), r.by, r.bucket, _ci(r.auroc, r.ci_low, r.ci_high), str(r.n),
             f"{r.n_pos} / {r.n_neg}", str(r.n_concepts)] for r in run.buckets]
    flags = ["null" if r.ci_low is None or float(r.ci_low) <= 0.5 else "" for r in run.buckets]
    return _table(("strategy", "layer", "by", "bucket", "AUROC [95% CI]", "n", "pos / neg", "concepts"), rows,
                  "buckets", flags)


def tier_tables(run: Run) -> str:
    """Per corpus tier: each strategy's AUROC across pairs with its CI, the same counting each positive against its
    own twin, and whether the best one's interval separates it from the others; the lexical baseline beside."""
    parts = []
    for tier, section in (run.leaderboard.get("by_tier") or {}).items():
        rows = section.get("rows") or []
        lexical = section.get("lexical") or {}
        said = (f"best {html.escape(str(section['best']))}: its interval lies above {section['n_excluded_by_best']} "
                f"of {section['n_others']} others, so this tier "
                + ("<b>separates</b> strategies" if section.get("separates") else "does <b>not</b> separate them")
                if section.get("best") else "no strategy scored")
        lex = (f"; lexical baseline mean {_num(lexical.get('mean'))}, max {_num(lexical.get('max'))}"
               if lexical.get("mean") is not None else "")
        table_rows = [[r["strategy"], str(r["layer"]), _ci(r["auroc"], r.get("ci_low"), r.get("ci_high")),
                       _num(r.get("auroc_with_twins")), str(r["n"])] for r in rows]
        flags = ["null" if r.get("ci_low") is None or float(r["ci_low"]) <= 0.5 else "" for r in rows]
        parts.append(f"<h4>{html.escape(tier)} tier</h4><p>{said}{lex}.</p>"
                     + _table(("strategy", "layer", "AUROC across pairs [95% CI]", "counting own twin", "n"),
                              table_rows, "tiers", flags))
    return "".join(parts)


def run_summary(run: Run) -> str:
    res, model, config = run.results, run.results.get("model") or {}, run.results.get("config") or {}
    concepts = sorted({c.concept for c in run.cells})
    first = {c.concept: c for c in reversed(run.cells) if c.probe == PRIMARY_PROBE}
    n_train = sum(c.n_train or 0 for c in first.values())
    n_test = sum(c.n_test or 0 for c in first.values())
    seeds = next((len(c.seed_cv_aurocs) for c in run.cells if c.seed_cv_aurocs), None)
    timing = res.get("timing") or {}
    runtime = " · ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v / 60:.1f} min" for k, v in timing.items()
                         if isinstance(v, (int, float)))
    corpus = res.get("corpus") or {}
    items = [
        ("model", f"{model.get('model_id', run.name)} ({model.get('kind', '?')}, {model.get('n_layers', '?')} layers, "
                  f"d = {model.get('hidden_size', '?')}, {model.get('dtype', '?')} on {model.get('device', '?')})"),
        ("layers probed", ", ".join(str(L) for L in res.get("layers") or sorted({c.layer for c in run.cells}))),
        ("strategies", str(len({c.strategy for c in run.cells}))),
        ("concepts", f"{len(concepts)}: {', '.join(concepts)}"),
        ("passages", f"{n_train} train + {n_test} test over all concepts (corpus {corpus.get('source', '?')}, "
                     f"size {corpus.get('size', '?')}, hash {str(corpus.get('hash', ''))[:12]})"),
        ("folds / bootstrap", f"{config.get('n_folds', '?')}-fold pair-grouped CV; "
                              f"{config.get('n_bootstrap', '?')} bootstrap resamples for every CI"),
        ("seeds", f"seed {res.get('seed', config.get('seed', '?'))}"
                  + (f"; {seeds} fold-shuffle seeds for seed σ" if seeds else "")),
        ("runtime", runtime or "—"),
        ("provenance", f"git {str(res.get('git_hash', ''))[:10]} · {res.get('date', '')} · store "
                       f"{res.get('store', '')}"),
    ]
    return "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items) + "</dl>"
