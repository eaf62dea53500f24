"""The report's figures as PNG bytes, each a pure function of a run: one colour, marker and line style per
strategy in every figure (series_styles), so a reader learns a strategy's look once."""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record
from poolbench.results.answer.leaderboard import FALLBACK_FLAG_RATE
from poolbench.results.answer.ranking import mean_t_interval, tie_groups
from poolbench.results.pages.report_runs import Run, primary_cells

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
class SeriesStyle:
    """How one strategy is drawn in every figure, so a reader learns it once."""

    color: str
    marker: str
    linestyle: str | tuple = "-"


UNSTYLED = SeriesStyle("#555555", "o")


def png_bytes(fig) -> bytes:
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
    return png_bytes(fig)


def probed_layers(run: Run) -> list[int]:
    """The layers the run probed (results.json's list, else every layer a cell names): the layer axis's ticks."""
    return sorted({int(L) for L in run.results.get("layers") or ()} or {c.layer for c in run.cells})


def layer_curves(run: Run) -> dict[str, list[tuple[int, float, float | None, float | None]]]:
    """Per leaderboard strategy, (layer, mean held-out D1, t-interval low, high) at each probed layer, over the
    concepts of its leaderboard row: the table's metric, so the figure and the table agree at the chosen layer."""
    cells, ticks = primary_cells(run), probed_layers(run)
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
    return png_bytes(fig)


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
    return png_bytes(fig)


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
    return png_bytes(fig)


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
    return png_bytes(fig)


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
    return png_bytes(fig)


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
    return png_bytes(fig)
