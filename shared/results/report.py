"""A run's results as one self-contained HTML page a person reads: matplotlib figures inlined as base64 PNG.

Input is what `poolbench-driver run` writes (results.json, leaderboard.json) read as typed records, plus the
per-prompt scores in the run's store for the D2 per-alpha intervals; a section whose data a run does not carry
says so in a note rather than being drawn empty.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from poolbench.atomic_write import write_text_atomic
from poolbench.errors import PoolBenchError
from poolbench.records.base import RecordError
from poolbench.records.breakdowns import BucketAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record, D3Record
from poolbench.results.answer import answer_html, build_answer
from poolbench.results.leaderboard import FALLBACK_FLAG_RATE, PRIMARY_PROBE, build_leaderboard
from poolbench.results.ranking import CI_LEVEL, group_letters, mean_t_interval, tie_groups
from poolbench.steerer.d2 import paired_delta
from poolbench.store.url import open_store

DPI = 100
FAMILY_ORDER = ("position_anchored", "uniform_aggregation", "window", "saliency_weighted", "structural_linguistic")
# Twenty colours far apart on white, in the order strategies take them (by family, then id): the 19 card strategies
# each get their own, and neighbours within a family differ in hue, not in shade.
PALETTE = ("#1f77b4", "#ff7f0e", "#d62728", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e7298a", "#bcbd22",
           "#000080", "#000000", "#e377c2", "#008080", "#800000", "#e6ab02", "#66a61e", "#7f7f7f", "#fb9a99",
           "#4169e1", "#a6761d")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<")
# A family also has its own line style, so a family reads as one kind of line in a panel of several.
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))


@dataclass(frozen=True)
class Figure:
    """One embedded figure: an id the page and the tests refer to, a caption and the PNG bytes."""

    fig_id: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class SeriesStyle:
    """How one strategy is drawn in every figure, so a reader learns it once."""

    color: str
    marker: str
    linestyle: str | tuple = "-"


UNSTYLED = SeriesStyle("#555555", "o")


@dataclass(frozen=True)
class Run:
    """One run folder's documents and their typed records; `name` labels it (the model id) when a report
    covers several runs."""

    name: str
    results: dict
    leaderboard: dict
    cells: list[D1CellRecord]
    d2: list[D2Record]  # every D2 record, null steering vectors included
    d3: list[D3Record]
    scorers: list[ScorerValidity]
    alpha_ci: dict[tuple[str, str, int], list[tuple[float, float]]] = field(default_factory=dict)
    alpha_ci_note: str | None = None  # why per-alpha intervals are missing, when they are
    lexical: list[LexicalBaselineRecord] = field(default_factory=list)
    buckets: list[BucketAurocRecord] = field(default_factory=list)


def load_runs(path: Path, store: str | None = None) -> list[Run]:
    """A run folder, or a folder of run folders (one per model): every results.json found, one level deep.
    `store` overrides where the runs' generations are read from (default: the store each run recorded)."""
    folders = [path] if (path / "results.json").is_file() else sorted(
        p for p in path.iterdir() if (p / "results.json").is_file()) if path.is_dir() else []
    if not folders:
        raise PoolBenchError(f"no results.json in {path} (nor in its subfolders)")
    runs = []
    for folder in folders:
        try:
            results = json.loads((folder / "results.json").read_text())
        except ValueError as exc:
            raise PoolBenchError(f"{folder / 'results.json'} is not valid JSON ({exc})") from exc
        if not results.get("cells"):
            raise PoolBenchError(f"{folder / 'results.json'} has no cells")
        try:
            cells = [D1CellRecord.from_dict(c) for c in results["cells"]]
            d2, d3, scorers = d2_records(results), d3_records(results), scorer_records(results)
            lexical = [LexicalBaselineRecord.from_dict(r) for r in results.get("lexical_baseline") or []]
            buckets = [BucketAurocRecord.from_dict(r) for r in results.get("d1_by_bucket") or []]
        except RecordError as exc:
            raise PoolBenchError(f"{folder / 'results.json'}: {exc}") from None
        board_path = folder / "leaderboard.json"
        board = json.loads(board_path.read_text()) if board_path.is_file() else build_leaderboard(cells)
        alpha_ci, note = alpha_intervals(results, d2, store)
        runs.append(Run((results.get("model") or {}).get("model_id") or folder.name, results, board, cells, d2, d3,
                        scorers, alpha_ci, note, lexical, buckets))
    return runs


def _listed(results: dict, *keys: str) -> list[dict]:
    """A section that runs kept as a list or as a dict by concept, under the first of `keys` present."""
    found = next((results[k] for k in keys if results.get(k)), None) or []
    if isinstance(found, dict):
        found = list(found.values())
    return [r for r in found if isinstance(r, dict)]


def d2_records(results: dict) -> list[D2Record]:
    """Every D2 record, wherever a run put them (results["d2"] or results["steering"]["d2"])."""
    found = _listed(results, "d2") or _listed(results.get("steering") or {}, "d2")
    return [D2Record.from_dict(r) for r in found]


def d3_records(results: dict) -> list[D3Record]:
    return [D3Record.from_dict(r) for r in _listed(results, "d3") or _listed(results.get("steering") or {}, "d3")]


def scorer_records(results: dict) -> list[ScorerValidity]:
    """Classifier-B validity records (results["scorers"], a list or a dict by concept)."""
    return [ScorerValidity.from_dict(r) for r in _listed(results, "scorers", "scorer_validity")]


def _store_url(results: dict, override: str | None) -> str | None:
    """The store a run wrote to: the override, else its --store, else the folder its results.json names."""
    if override:
        return override
    configured = (results.get("config") or {}).get("store")
    if configured:
        return configured
    recorded = str(results.get("store") or "")
    return recorded.removeprefix("local:") if recorded.startswith("local:") else None


def alpha_intervals(results: dict, d2: Sequence[D2Record], store: str | None = None
                    ) -> tuple[dict[tuple[str, str, int], list[tuple[float, float]]], str | None]:
    """Per steering cell, the CI of the mean concept score at each alpha on the report half of the prompts,
    resampling prompts as Delta(alpha*) does; from the per-prompt scores in the store (results.json keeps means)."""
    cells = [r for r in d2 if r.per_alpha and r.generations_key and r.report_prompts]
    if not cells:
        return {}, None
    config = results.get("steering", {}).get("steering_config", {})
    n_bootstrap, seed = int(config.get("n_bootstrap", 1000)), int(config.get("seed", 0))
    try:
        opened = open_store(_store_url(results, store))
        out = {}
        for r in cells:
            table = opened.get_table(str(r.generations_key)).to_pydict()
            steered = [i for i, kind in enumerate(table["kind"]) if kind == "steered"]
            by_alpha: dict[float, dict[int, float]] = defaultdict(dict)
            for i in steered:
                by_alpha[float(table["alpha"][i])][int(table["prompt_index"][i])] = table[f"score_{r.concept}"][i]
            intervals = []
            for alpha in r.alphas:
                values = np.array([by_alpha[float(alpha)][p] for p in r.report_prompts])
                ci = paired_delta(values, np.zeros_like(values), n_bootstrap=n_bootstrap, seed=seed,
                                  level=CI_LEVEL)
                intervals.append((float(ci["ci_low"]), float(ci["ci_high"])))
            out[(r.concept, r.strategy, r.layer)] = intervals
    except (PoolBenchError, KeyError, OSError) as exc:
        return {}, f"per-α intervals need the run's generations, which could not be read ({exc})"
    return out, None


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def family_of(run: Run) -> dict[str, str]:
    """Strategy id -> family, from results.json's strategy specs, else the leaderboard rows."""
    families = {r["strategy"]: r.get("family", "other") for r in run.leaderboard["strategies"]}
    families.update({s["id"]: s.get("family") or "other" for s in run.results.get("strategies") or []})
    return families


def series_styles(families: Mapping[str, str]) -> dict[str, SeriesStyle]:
    """Per strategy its own colour (by family, then id) and a marker distinct within its family, whose first marker
    differs from the other families' first; the line style is the family's."""
    by_family: dict[str, list[str]] = defaultdict(list)
    for strategy, family in families.items():
        by_family[family].append(strategy)
    styles, n = {}, 0
    for f, family in enumerate(sorted(by_family, key=_family_order)):
        for i, strategy in enumerate(sorted(by_family[family])):
            styles[strategy] = SeriesStyle(PALETTE[n % len(PALETTE)], MARKERS[(f + i) % len(MARKERS)],
                                           LINESTYLES[f % len(LINESTYLES)])
            n += 1
    return styles


def _family_order(family: str) -> tuple[int, str]:
    return (FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER), family)


def heatmap_figure(run: Run) -> bytes:
    """Concept × strategy held-out D1 at each strategy's CV-chosen layer, annotated with the value."""
    rows = sorted(run.leaderboard["strategies"], key=lambda r: -r["mean_d1"])
    strategies = [r["strategy"] for r in rows]
    concepts = sorted({c for r in rows for c in r["per_concept"]})
    grid = np.array([[r["per_concept"].get(c, {}).get("auroc", np.nan) for r in rows] for c in concepts])
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * len(strategies), 1.0 + 0.38 * len(concepts)))
    im = ax.imshow(grid, cmap="viridis", vmin=0.5, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(strategies)), strategies, rotation=45, ha="right")
    ax.set_yticks(range(len(concepts)), concepts)
    for i in range(len(concepts)):
        for j in range(len(strategies)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i, j] < 0.8 else "black")
    fig.colorbar(im, ax=ax, label="D1 (test AUROC)")
    ax.set_title(f"D1 per concept and strategy — {run.name}")
    return _png(fig)


def _primary_cells(run: Run) -> dict[tuple[str, int, str], D1CellRecord]:
    return {(c.strategy, c.layer, c.concept): c for c in run.cells if c.probe == PRIMARY_PROBE}


def probed_layers(run: Run) -> list[int]:
    """The layers the run probed (results.json's list, else every layer a cell names): the layer axis's ticks."""
    return sorted({int(L) for L in run.results.get("layers") or ()} or {c.layer for c in run.cells})


def layer_curves(run: Run) -> dict[str, list[tuple[int, float, float | None, float | None]]]:
    """Per leaderboard strategy, (layer, mean held-out D1, t-interval low, high) at each probed layer, over the
    concepts of its leaderboard row: the table's metric, so the figure and the table agree at the chosen layer."""
    cells, ticks = _primary_cells(run), probed_layers(run)
    curves = {}
    for row in run.leaderboard["strategies"]:
        s, points = row["strategy"], []
        for L in ticks:
            values = [cells[(s, L, c)].test_auroc for c in row["per_concept"] if (s, L, c) in cells]
            if values:
                points.append((L, *mean_t_interval(values)))
        curves[s] = points
    return curves


def layer_curve_figure(run: Run) -> bytes:
    """Per family a panel; per strategy the mean held-out D1 (test AUROC, the table's metric) over concepts at
    each probed layer with its 95% t-interval over concepts (none drawn below three concepts), the layer chosen
    on CV ringed."""
    families = family_of(run)
    styles = series_styles(families)
    rows_by_family: dict[str, list[dict]] = defaultdict(list)
    for row in run.leaderboard["strategies"]:
        rows_by_family[families.get(row["strategy"], "other")].append(row)
    panels = sorted(rows_by_family, key=_family_order)
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.9 * nrows), squeeze=False, sharey=True)
    ticks, curves = probed_layers(run), layer_curves(run)
    no_band = any(low is None for curve in curves.values() for _, _, low, _ in curve)
    for ax, family in zip(axes.flat, panels, strict=False):
        for row in sorted(rows_by_family[family], key=lambda r: r["strategy"]):
            s, style = row["strategy"], styles[row["strategy"]]
            layers, means = [p[0] for p in curves[s]], [p[1] for p in curves[s]]
            lows = [np.nan if p[2] is None else p[2] for p in curves[s]]
            highs = [np.nan if p[3] is None else p[3] for p in curves[s]]
            ax.plot(layers, means, color=style.color, marker=style.marker, ls=style.linestyle, label=s, lw=1.6, ms=6)
            ax.fill_between(layers, lows, highs, color=style.color, alpha=0.12, lw=0)
            if int(row["best_layer"]) in layers:
                best = layers.index(int(row["best_layer"]))
                ax.plot(layers[best], means[best], marker="o", ms=13, mfc="none", mec="black", mew=1.2)
        ax.set_title(family.replace("_", " "), fontsize=10)
        ax.set_xticks(ticks)
        if len(ticks) == 1:
            ax.set_xlim(ticks[0] - 0.5, ticks[0] + 0.5)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("layer (probed layers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    for ax in axes[:, 0]:
        ax.set_ylabel("mean D1 (test AUROC) over concepts")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if no_band:
        fig.suptitle("no interval band: fewer than 3 concepts (a t-interval over 2 is not informative)",
                     fontsize=9, color="#8a5a00")
    fig.tight_layout(h_pad=3.0)
    return _png(fig)


def alpha_figure(run: Run, records: Sequence[D2Record]) -> bytes:
    """Per concept two panels on shared y ranges: the mean concept score against α on the report half (95%
    interval per α when the store has the generations, α* starred, the prompted baseline dashed) and the
    fluency ratio against α with the guard steering must pass. Points past the guard are hollow."""
    styles = series_styles(family_of(run))
    by_concept: dict[str, list[D2Record]] = defaultdict(list)
    for r in records:
        by_concept[r.concept].append(r)
    concepts = sorted(by_concept)
    fig, axes = plt.subplots(2, len(concepts), figsize=(4.4 * len(concepts), 6.6), squeeze=False, sharey="row",
                             gridspec_kw={"height_ratios": [3, 2]})
    guards = sorted({float(r.fluency_guard) for r in records if r.fluency_guard is not None})
    for top, bottom, concept in zip(axes[0], axes[1], concepts, strict=True):
        series = sorted(by_concept[concept], key=lambda r: (r.strategy, r.layer))
        grid = sorted({float(p.alpha) for r in series for p in r.per_alpha or []})
        starred = False
        for k, r in enumerate(series):
            rows = r.per_alpha or []
            x = np.array([grid.index(float(p.alpha)) for p in rows]) + 0.08 * (k - (len(series) - 1) / 2)
            scores = np.array([p.score for p in rows])
            style = styles.get(r.strategy, UNSTYLED)
            ci = run.alpha_ci.get((r.concept, r.strategy, r.layer))
            err = None if ci is None else np.abs([scores - [lo for lo, _ in ci], [hi for _, hi in ci] - scores])
            top.errorbar(x, scores, yerr=err, color=style.color, marker=style.marker, ls=style.linestyle, capsize=3,
                         lw=1.5, label=f"{r.strategy} (layer {r.layer}, {r.selected_because or 'run'})")
            ratios = np.array([np.nan if p.fluency_ratio is None else float(p.fluency_ratio) for p in rows])
            bottom.plot(x, ratios, color=style.color, marker=style.marker, ls=style.linestyle, lw=1.2)
            if r.fluency_guard is not None:
                broken = ratios > float(r.fluency_guard)
                for ax, y in ((top, scores), (bottom, ratios)):
                    ax.plot(x[broken], y[broken], ls="none", marker=style.marker, ms=7, mfc="white",
                            mec=style.color, zorder=4)
            if r.alpha_star is not None and float(r.alpha_star) in grid:
                i = [float(p.alpha) for p in rows].index(float(r.alpha_star))
                top.plot([x[i]], [scores[i]], marker="*", ms=17, color=style.color, mec="black", ls="none", zorder=5,
                         label=None if starred else "α* (star)")
                starred = True
        prompted = sorted({(float(r.prompted_score), r.prompted_fluency_ratio) for r in series
                           if r.prompted_score is not None})
        for n, (score, ratio) in enumerate(prompted):
            top.axhline(score, color="black", ls="--", lw=1.1,
                        label="prompted baseline (unsteered instruction)" if n == 0 else None)
            if ratio is not None:
                bottom.axhline(float(ratio), color="black", ls="--", lw=1.1)
        for guard in guards:
            bottom.axhline(guard, color="firebrick", lw=1.4, label=f"fluency guard (ratio ≤ {guard:g})")
        bottom.set_yscale("log")
        for ax in (top, bottom):
            ax.set_xticks(range(len(grid)), [f"{a:g}" for a in grid])
            ax.set_xlim(-0.5, len(grid) - 0.5)
            ax.grid(alpha=0.3)
        top.set_title(concept, fontsize=10)
        bottom.set_xlabel("α (× the layer's mean residual norm)")
        handles, labels = top.get_legend_handles_labels()
        guard_handles, guard_labels = bottom.get_legend_handles_labels()
        hollow = Line2D([], [], ls="none", marker="o", mfc="white", mec="black", label="hollow: past the guard")
        bottom.legend([*handles, *guard_handles, hollow], [*labels, *guard_labels, hollow.get_label()], fontsize=7,
                      loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1, frameon=False)
    axes[0][0].set_ylabel("mean concept score (report half)")
    axes[1][0].set_ylabel("fluency ratio (perplexity / α = 0)")
    fig.tight_layout()
    return _png(fig)


def cd_figure(friedman: dict, name: str) -> bytes:
    """Demšar's critical-difference diagram: average ranks on an axis, tie groups as bars under it, and every
    label below all bars, outside the axis, so no bar crosses a label."""
    ranks = dict(sorted(friedman["average_ranks"].items(), key=lambda kv: (kv[1], kv[0])))
    cd, k = float(friedman["critical_difference"]), int(friedman["k"])
    names, values = list(ranks), np.array(list(ranks.values()))
    groups = [g for g in tie_groups(ranks, cd) if len(g) > 1]
    half = (len(names) + 1) // 2
    bar_step, label_step = 0.22, 0.42
    top_label = -0.35 - bar_step * len(groups) - 0.3
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.22 * len(groups) + 0.3 * half))
    ax.set_xlim(1, k)
    ax.set_ylim(top_label - label_step * half - 0.2, 1.5)
    ax.hlines(0, 1, k, color="black")
    for r in range(1, k + 1):
        ax.vlines(r, 0, 0.12, color="black")
        ax.text(r, 0.22, str(r), ha="center", fontsize=8)
    ax.plot([1, 1 + cd], [1.0, 1.0], color="firebrick", lw=2)
    ax.text(1 + cd / 2, 1.12, f"CD = {cd:.2f}", ha="center", fontsize=8, color="firebrick")
    for depth, group in enumerate(groups):
        y = -0.35 - bar_step * depth
        ax.hlines(y, ranks[group[0]] - 0.04, ranks[group[-1]] + 0.04, color="black", lw=3)
    for i, (label, rank) in enumerate(zip(names, values, strict=True)):
        left = i < half
        y = top_label - label_step * (i if left else len(names) - 1 - i)
        x_end = 1 - 0.15 * (k / 10) if left else k + 0.15 * (k / 10)
        ax.plot([rank, rank, x_end], [0, y, y], color="dimgray", lw=0.8, clip_on=False)
        text = f"{label} ({rank:.2f}) " if left else f" {label} ({rank:.2f})"
        ax.text(x_end, y, text, ha="right" if left else "left", va="center", fontsize=8, clip_on=False)
    ax.axis("off")
    ax.set_title(f"Critical difference (Nemenyi, α = {friedman.get('alpha', 0.05)}) — {name}", fontsize=10, pad=14)
    return _png(fig)


def fallback_figure(run: Run) -> bytes | None:
    """Fallback rate per (strategy, concept) cell at the strategy's chosen layer, as the leaderboard flags it;
    cells above 50% boxed in red. None when no strategy fell back anywhere."""
    rows = [r for r in run.leaderboard["strategies"]
            if any(v.get("fallback_rate", 0) > 0 for v in r["per_concept"].values())]
    if not rows:
        return None
    rows.sort(key=lambda r: r["strategy"])
    concepts = sorted({c for r in run.leaderboard["strategies"] for c in r["per_concept"]})
    grid = np.array([[r["per_concept"].get(c, {}).get("fallback_rate", np.nan) for c in concepts] for r in rows])
    fig, ax = plt.subplots(figsize=(2.5 + 0.62 * len(concepts), 1.4 + 0.42 * len(rows)))
    im = ax.imshow(grid, cmap="Greys", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(concepts)), concepts, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), [f"{r['strategy']} (L{r['best_layer']})" for r in rows])
    for i in range(len(rows)):
        for j in range(len(concepts)):
            v = grid[i, j]
            if not np.isfinite(v):
                continue
            flagged = v > FALLBACK_FLAG_RATE
            ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                    color="firebrick" if flagged else ("white" if v > 0.45 else "black"),
                    fontweight="bold" if flagged else "normal")
            if flagged:
                ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, fill=False, ec="firebrick", lw=2))
    fig.colorbar(im, ax=ax, label="fallback rate (share of passages)")
    ax.set_title(f"Fallback rate (%) per cell; red box: above {FALLBACK_FLAG_RATE:.0%} — {run.name}", fontsize=10)
    return _png(fig)


def scorer_figure(run: Run, records: list[ScorerValidity]) -> bytes:
    """Held-out AUROC of each concept's scorer with its CI and the validity bar it must clear."""
    records = sorted(records, key=lambda r: r.concept)
    auroc = np.array([r.heldout_auroc for r in records], dtype=float)
    low = np.array([a if r.heldout_auroc_ci_low is None else r.heldout_auroc_ci_low
                    for r, a in zip(records, auroc, strict=True)], dtype=float)
    high = np.array([a if r.heldout_auroc_ci_high is None else r.heldout_auroc_ci_high
                     for r, a in zip(records, auroc, strict=True)], dtype=float)
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * len(records), 3.6))
    colors = ["steelblue" if r.valid else "firebrick" for r in records]
    ax.bar([r.concept for r in records], auroc, yerr=[auroc - low, high - auroc], color=colors, capsize=3)
    bar = records[0].min_auroc
    if bar is not None:
        ax.axhline(bar, color="firebrick", ls="--", lw=1, label=f"min AUROC {bar}")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_ylim(0.4, 1.02)
    ax.set_ylabel("held-out AUROC")
    ax.tick_params(axis="x", rotation=45)
    ax.set_title(f"Scorer (classifier B) validity — {run.name}")
    return _png(fig)


# ---- tables -------------------------------------------------------------------------------------------------


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
    """Per strategy: mean D1 with its CI over concepts, tie group letters, win rate, average rank and the
    reliability columns (means over concepts at the chosen layer)."""
    cells = _primary_cells(run)
    friedman = _friedman(run)
    letters = group_letters(tie_groups(friedman["average_ranks"], float(friedman["critical_difference"]))) \
        if friedman else {}
    rows = []
    for r in sorted(run.leaderboard["strategies"], key=lambda r: r["rank"]):
        chosen = [cells.get((r["strategy"], int(r["best_layer"]), c)) for c in r["per_concept"]]
        chosen = [c for c in chosen if c is not None]
        mean, low, high = mean_t_interval([v["auroc"] for v in r["per_concept"].values()])
        rows.append([str(r["rank"]), r["strategy"], r.get("family", "—"), _ci(mean, low, high),
                     _num(r["mean_cv_auroc"]), str(r["best_layer"]), _num(r.get("win_rate")),
                     _num(r.get("average_rank"), 2), letters.get(r["strategy"], "—"),
                     _num(_mean_of([c.seed_std for c in chosen]), 4), _num(_mean_of([c.selectivity for c in chosen])),
                     _num(_mean_of([c.mdl_compression for c in chosen]), 2),
                     ", ".join(r.get("fallback_flagged_concepts") or []) or "—"])
    columns = ("rank", "strategy", "family", "mean D1 [95% CI]", "mean CV", "layer", "win rate", "avg rank",
               "tie group", "seed σ", "selectivity", "MDL", ">50% fallback")
    return _table(columns, rows, "leaderboard")


def _friedman(run: Run) -> dict | None:
    friedman = (run.results.get("reliability") or {}).get("friedman") or run.leaderboard.get("friedman")
    return friedman if friedman and friedman.get("average_ranks") else None


def friedman_html(run: Run) -> str:
    friedman = _friedman(run)
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
    cells, lexical = _primary_cells(run), {r.concept: r for r in run.lexical}
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


def bucket_figure(run: Run) -> bytes:
    """Held-out AUROC per density and per placement bucket, a line per strategy with its 95% CI."""
    styles = series_styles(family_of(run))
    kinds = [by for by in ("density", "placement") if any(r.by == by for r in run.buckets)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds), 3.8), squeeze=False, sharey=True)
    strategies = list(dict.fromkeys(r.strategy for r in run.buckets))
    for ax, by in zip(axes[0], kinds, strict=True):
        labels = list(dict.fromkeys(r.bucket for r in run.buckets if r.by == by))
        for k, strategy in enumerate(strategies):
            rows = [r for r in run.buckets if r.by == by and r.strategy == strategy and r.auroc is not None]
            if not rows:
                continue
            x = np.array([labels.index(r.bucket) for r in rows]) + 0.06 * (k - (len(strategies) - 1) / 2)
            y = np.array([float(r.auroc) for r in rows])
            err = np.abs([y - [float(r.ci_low if r.ci_low is not None else r.auroc) for r in rows],
                          [float(r.ci_high if r.ci_high is not None else r.auroc) for r in rows] - y])
            style = styles.get(strategy, UNSTYLED)
            ax.errorbar(x, y, yerr=err, color=style.color, marker=style.marker, capsize=3, lw=1.5,
                        label=f"{strategy} (layer {rows[0].layer})")
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlabel("signal sentences per passage" if by == "density" else "where the signal sits")
        ax.set_title(f"D1 by {by}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out AUROC (within concept)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return _png(fig)


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


# ---- the page -----------------------------------------------------------------------------------------------

HOW_TO_READ = {
    "summary": "What ran: the model, the layers probed, how many passages every D1 cell saw, how the statistics "
               "were drawn and how long it took.",
    "leaderboard": "Strategies in order of mean D1: the held-out test AUROC at each strategy's layer (chosen on "
                   "training CV, never on the test split), averaged over concepts; its 95% CI is a t-interval "
                   "over concepts. <b>rank</b> orders that mean. <b>avg rank</b> is the Friedman average rank over "
                   "the concepts, each strategy at its chosen layer (the blocks the Friedman line names). "
                   "Strategies that share a "
                   "<b>tie group</b> letter have average ranks within the critical difference: the Nemenyi test "
                   "cannot tell them apart. Seed σ (spread of CV AUROC over fold shuffles), selectivity (CV AUROC "
                   "above a control task of random pair labels) and MDL (compression of the labels; above 1 means "
                   "learnable from few examples) are means over concepts at the chosen layer.",
    "cd": "Average ranks on the axis (1 is best). Each black bar joins strategies whose ranks differ by less "
          "than the critical difference (red): within a bar, no difference is significant.",
    "heatmap": "Held-out D1 per concept and strategy at the strategy's chosen layer; 0.5 is chance. The CIs are "
               "in the per-concept tables below.",
    "layers": "One panel per family, ticks at the probed layers. A line is a strategy's mean held-out D1 (test "
              "AUROC, the leaderboard's metric) over concepts at each layer, the band its 95% t-interval over "
              "concepts (not drawn below three concepts); the ring marks the layer the leaderboard uses, chosen on "
              "training CV, so it need not be the line's peak.",
    "fallback": "The share of passages in which a strategy selected no token and fell back to the mean, per "
                "concept at the chosen layer. Boxed cells pass 50%: there the strategy is mostly A1_mean. "
                "Strategies that never fell back are left out.",
    "per_concept": "Click a concept (hardest first) for every strategy's D1 with its 95% pair-bootstrap CI at "
                   "the strategy's layer. Grey rows: the CI reaches 0.5 (not above chance); amber rows: more "
                   "than half the passages fell back.",
    "lexical": "A bag of words per concept: TF-IDF of the passage's words and a logistic regression at the probes' "
               "C, fitted on the train split and scored on the test split, with the same pair-bootstrap CI as D1. "
               "It sees no model: a concept it already separates is carried by its vocabulary, and a strategy's D1 "
               "there says little about pooling. Amber rows: the lexical CI lies above 0.9.",
    "tiers": "The standard tier's pairs differ in their words; the hard tier's positive and negative share their "
             "content words and differ in what the words mean together (negation scope, who did what, quoted vs "
             "asserted), so a bag of words scores 0.5 there. Each strategy at its CV-chosen layer, its probe refitted "
             "on the whole train split; the AUROC compares positives with negatives of other pairs of the same "
             "concept (CI over matched pairs); 'counting own twin' adds each positive against its own rewrite, the "
             "minimal pair. Grey rows: the CI reaches 0.5.",
    "buckets": "Test passages grouped by how many concept sentences they hold (density) and where those sit "
               "(placement), for the best strategy and a few whose reach depends on place, each at its CV-chosen "
               "layer with its probe refitted on the whole train split. A bucket's AUROC compares positives only "
               "with negatives of the same concept (each concept has its own probe, so scores of two concepts "
               "share no scale); the CI resamples matched pairs. Grey rows: the CI reaches 0.5.",
    "d2": "Each row steers a concept's text with a strategy's DiffMean vector. α* maximises the harmonic mean of "
          "score, fluency and relevance on one half of the prompts; Δ(α*) is the score gain over α = 0 on the "
          "other half, with its CI; SCP is Spearman ρ(α, score) over all generations. Fluency ratio (perplexity "
          "against α = 0; guard ≤ 2) and relevance are at α*. Prompted Δ is what an instruction prefix achieves "
          "without steering: steering earns its keep when Δ(α*) beats it.",
    "alpha": "Top: mean concept score on the report half at each α, with 95% intervals from resampling prompts; "
             "the star is α*, the dashed line what the unsteered instruction prompt scores. Bottom: the fluency "
             "ratio (perplexity against α = 0) with the guard (red) that steering must pass and the prompted "
             "text's ratio (dashed); hollow points are past the guard. The score panels share one y range, as do "
             "the fluency panels. A flat line means steering did not move the scorer.",
    "d3": "Steering toward a concept, read by a neighbour's scorer: Disent = 1 − Δ_B/Δ_A, 1 when only the target "
          "moved. It is null when Δ_A's CI includes 0 (nothing to compare against); LD is a distant neighbour, "
          "LC a close one. D3_rep is the cosine of the two concepts' steering vectors.",
    "scorers": "Classifier B per concept: held-out AUROC with its CI; below the bar a scorer is refused.",
    "defs": "What each strategy pools, as the run's registry defined it.",
}

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1500px;color:#222}
h3{margin-top:2em;border-bottom:1px solid #ddd}
figure{margin:1em 0}img{display:block;max-width:100%;height:auto}figcaption{font-size:.9em;color:#555}
table{border-collapse:collapse;font-size:.82em;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;
text-align:right;white-space:nowrap}td:first-child,td:nth-child(2),th{text-align:left}
table.defs td{text-align:left;white-space:normal}
tr.null td{color:#888;background:#f4f4f4}tr.flag td{background:#fff3d6}
.how{background:#eef4fb;border-left:4px solid #6a9fd4;padding:.4em .8em;font-size:.9em;max-width:70em}
.note{color:#8a5a00}dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}
dd{margin:0}details{margin:.3em 0}summary{cursor:pointer}
div.answer{background:#f3f8ef;border-left:4px solid #5b9a3c;padding:.2em 1em .6em;max-width:80em}
div.answer h3{border:0;margin-top:.6em}div.answer p{margin:.3em 0}"""


def _how(key: str) -> str:
    return f'<p class="how"><b>How to read this.</b> {HOW_TO_READ[key]}</p>'


def _figure_html(fig: Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (f'<figure><img data-figure="{fig.fig_id}" alt="{html.escape(fig.caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.caption)}</figcaption></figure>')


def run_section(run: Run, index: int) -> tuple[str, list[Figure]]:
    """One run's part of the page, in reading order, and its figures."""
    tag, figures, parts = f"run{index}", [], []

    def figure(suffix: str, caption: str, png: bytes) -> None:
        fig = Figure(f"{tag}-{suffix}", f"{caption} — {run.name}", png)
        figures.append(fig)
        parts.append(_figure_html(fig))

    def note(text: str) -> None:
        parts.append(f'<p class="note">{html.escape(text)}</p>')

    parts += [f"<section><h2>{html.escape(run.name)}</h2>", answer_html(build_answer(run.results, run.leaderboard)),
              "<h3>Run summary</h3>", _how("summary"),
              run_summary(run), "<h3>Leaderboard</h3>", _how("leaderboard"), friedman_html(run),
              leaderboard_table(run)]
    friedman = _friedman(run)
    if friedman:
        parts += ["<h3>Critical difference</h3>", _how("cd")]
        figure("cd", "Critical-difference diagram", cd_figure(friedman, run.name))
    else:
        note("No critical-difference diagram: no Friedman test in this run.")
    parts += ["<h3>D1 per concept and strategy</h3>", _how("heatmap")]
    figure("heatmap", "D1 heatmap (concept × strategy)", heatmap_figure(run))
    parts += ["<h3>Layer curves</h3>", _how("layers")]
    figure("layers", "Layer curves per family, 95% t-interval over concepts", layer_curve_figure(run))
    parts += ["<h3>Fallback rates</h3>", _how("fallback")]
    png = fallback_figure(run)
    if png is None:
        note("No strategy fell back to the mean on any passage.")
    else:
        figure("fallback", "Fallback rate per (strategy, concept) cell", png)
    parts += ["<h3>Per concept</h3>", _how("per_concept"), per_concept_html(run), "<h3>Lexical baseline</h3>"]
    if run.lexical:
        parts += [_how("lexical"), lexical_table(run)]
    else:
        note("No lexical baseline in this run (it predates the baseline).")
    parts.append("<h3>D1 by corpus tier</h3>")
    if run.leaderboard.get("by_tier"):
        parts += [_how("tiers"), tier_tables(run)]
    else:
        note("No D1 by tier: the corpus marks no tiers (most user corpora), or the run predates them.")
    parts.append("<h3>D1 by density and placement</h3>")
    if run.buckets:
        parts.append(_how("buckets"))
        figure("buckets", "D1 by density and by placement, 95% pair-bootstrap CI", bucket_figure(run))
        parts.append(bucket_table(run))
    else:
        note("No D1 by density and placement: the corpus records no density and placement (v1, most user "
             "corpora), or the run predates the breakdown.")

    parts.append("<h3>D2: steering</h3>")
    if run.d2:
        parts += [_how("d2"), d2_summary(run.d2), d2_table(run.d2)]
        curves = [r for r in run.d2 if r.per_alpha]
        if curves:
            parts.append(_how("alpha"))
            if run.alpha_ci_note:
                note(run.alpha_ci_note)
            figure("alpha", "D2 α curves (report half" + (", 95% intervals)" if run.alpha_ci else ")"),
                   alpha_figure(run, curves))
    else:
        note("No D2 results in this run (it ran with --no-steering, or predates steering): no table, no α curves.")
    parts.append("<h3>D3: disentanglement</h3>")
    if run.d3:
        parts += [_how("d3"), d3_table(run.d3)]
    else:
        note("No D3 results in this run.")
    parts.append("<h3>Scorer validity</h3>")
    valid = [s for s in run.scorers if s.heldout_auroc is not None]
    if valid:
        parts += [_how("scorers"), scorer_table(valid)]
        figure("scorer", "Scorer (classifier B) validity", scorer_figure(run, valid))
    else:
        note("No scorer (classifier B) records in this run: validity is not drawn.")
    parts += ["<h3>Strategy definitions</h3>", _how("defs"), strategy_table(run), "</section>"]
    return "".join(parts), figures


def render_report(runs: list[Run]) -> tuple[str, list[Figure]]:
    """The HTML page and the figures in it (each <img> carries data-figure=<fig_id>)."""
    sections, all_figures = [], []
    for i, run in enumerate(runs):
        body, figures = run_section(run, i)
        sections.append(body)
        all_figures += figures
    page = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>PoolBench report</title>"
            f"<style>{_STYLE}</style></head><body><h1>PoolBench report</h1>{''.join(sections)}</body></html>")
    return page, all_figures


def write_report(run_dir: Path, out: Path, store: str | None = None) -> list[Figure]:
    """Render the report for `run_dir` into `out` (written whole, then renamed)."""
    page, figures = render_report(load_runs(run_dir, store))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, page)
    return figures
