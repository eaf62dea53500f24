"""The report of a run over several models: the cross-model page first (answer box with Kendall's W, the
strategy × model heatmap, relative-depth layer curves with one line style per model, the table), then each
model's own report section as a single-model run's report shows it."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from poolbench.atomic_write import write_text_atomic
from poolbench.errors import PoolBenchError
from poolbench.results.answer.cross_model import model_cell_text
from poolbench.results.documents.cross_model_outputs import is_cross_model
from poolbench.results.pages.report import PAGE_STYLE, Figure, figure_html, run_section
from poolbench.results.pages.report_figures import FAMILY_ORDER, png_bytes, series_styles
from poolbench.results.pages.report_runs import load_runs

MODEL_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)))
MODEL_MARKERS = ("o", "s", "^", "D", "v", "P")
HOW = {
    "heatmap": "Each cell is the strategy's mean held-out D1 over the concepts every model probed, at the layer that "
               "model's training-split CV chose for it; the small number is its rank within the model (1 = best, "
               "ties share the average rank). Rows are in mean-rank order over models.",
    "depth": "Mean out-of-fold (train-split) AUROC over concepts at each probed layer, against relative depth "
             "layer/(n_layers − 1), so models of different depths overlay: 0 is the first block, 1 the last. One "
             "panel per strategy family, one colour per strategy, one line style per model.",
    "table": "Mean D1 [95% t-interval over concepts], rank within the model, the CV-chosen layer and its relative "
             "depth; Kendall's W below measures how alike the models rank the strategies (1 = identical order, "
             "0 = unrelated).",
}


def _how(key: str) -> str:
    return f'<p class="how"><b>How to read this.</b> {HOW[key]}</p>'


def cross_model_heatmap(table: dict) -> bytes:
    """Strategy × model mean D1, annotated with the value and the rank within the model."""
    models = [m["name"] for m in table["models"]]
    rows = table["rows"]
    grid = np.array([[r["per_model"][m]["mean_d1"] for m in models] for r in rows])
    ranks = np.array([[r["per_model"][m]["rank"] for m in models] for r in rows])
    fig, ax = plt.subplots(figsize=(2.5 + 1.6 * len(models), 1.2 + 0.36 * len(rows)))
    im = ax.imshow(grid, cmap="viridis", vmin=0.5, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(models)), [f"{m}\n({t['n_layers']} layers)" for m, t in zip(models, table["models"],
                                                                                      strict=True)])
    ax.set_yticks(range(len(rows)), [f"{r['strategy']} ({r['mean_rank']:.1f})" for r in rows])
    for i in range(len(rows)):
        for j in range(len(models)):
            ax.text(j, i, f"{grid[i, j]:.3f}  #{ranks[i, j]:g}", ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] < 0.8 else "black")
    fig.colorbar(im, ax=ax, label="mean D1 (held-out AUROC)")
    a = table["agreement"]
    ax.set_title(f"Mean D1 per strategy and model (Kendall's W = {a['kendall_w']:.2f})")
    return png_bytes(fig)


def relative_depth_figure(table: dict) -> bytes:
    """Per family one panel: each strategy's CV layer curve against relative depth, a line style per model."""
    models = [m["name"] for m in table["models"]]
    families: dict[str, list[dict]] = defaultdict(list)
    for row in table["rows"]:
        families[row.get("family") or "other"].append(row)
    styles = series_styles({r["strategy"]: r.get("family") or "other" for r in table["rows"]})
    names = sorted(families, key=lambda f: (FAMILY_ORDER.index(f) if f in FAMILY_ORDER else len(FAMILY_ORDER), f))
    cols = min(3, len(names))
    n_rows = -(-len(names) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5.2 * cols, 3.6 * n_rows), squeeze=False, sharey=True)
    for ax, family in zip(axes.flat, names, strict=False):
        for row in families[family]:
            for k, model in enumerate(models):
                curve = row["per_model"][model]["layer_curve"]
                xs = [float(x) for x in curve]
                ax.plot(xs, list(curve.values()), color=styles[row["strategy"]].color,
                        linestyle=MODEL_LINESTYLES[k % len(MODEL_LINESTYLES)],
                        marker=MODEL_MARKERS[k % len(MODEL_MARKERS)], markersize=3, linewidth=1.2,
                        label=row["strategy"] if k == 0 else None)
        ax.set_title(family)
        ax.set_xlim(-0.02, 1.02)
        ax.set_xlabel("relative depth (layer / (n_layers − 1))")
        ax.set_ylabel("mean CV AUROC")
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    handles = [Line2D([0], [0], color="black", linestyle=MODEL_LINESTYLES[k % len(MODEL_LINESTYLES)],
                      marker=MODEL_MARKERS[k % len(MODEL_MARKERS)], label=model) for k, model in enumerate(models)]
    fig.legend(handles=handles, loc="upper center", ncol=len(models), title="line style = model")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return png_bytes(fig)


def cross_model_table_html(table: dict) -> str:
    models = [m["name"] for m in table["models"]]
    head = "".join(f"<th>{html.escape(m)}</th>" for m in models)
    body = []
    for row in table["rows"]:
        cells = [f"<td>{model_cell_text(row['per_model'][model], ' · ')}</td>" for model in models]
        body.append(f"<tr><td>{row['mean_rank']:.1f}</td><td>{html.escape(row['strategy'])}</td>{''.join(cells)}</tr>")
    return (f'<table class="cross-model"><thead><tr><th>mean rank</th><th>strategy</th>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def agreement_html(table: dict) -> str:
    """The answer box: who is best where and Kendall's W with its interval and p, first on the page."""
    a = table["agreement"]
    sentences = "".join(f"<p>{html.escape(s)}</p>" for s in table["answer"])
    return (f'<div class="answer" data-kendall-w="{a["kendall_w"]:.6f}"><h3>Answer across models</h3>{sentences}'
            f'<p class="note">{html.escape(a["p_value_method"])}; interval: {html.escape(a["interval_method"])}.'
            "</p></div>")


def cross_model_section(table: dict) -> tuple[str, list[Figure]]:
    """The cross-model part of the page and its two figures."""
    figures = [Figure("cross-heatmap", "Mean D1 per strategy and model (strategy × model)", cross_model_heatmap(table)),
               Figure("cross-depth", "Layer curves by relative depth, one line style per model",
                      relative_depth_figure(table))]
    parts = ["<section><h2>Across models</h2>", agreement_html(table), "<h3>Strategy × model</h3>", _how("heatmap"),
             figure_html(figures[0]), "<h3>Layer curves by relative depth</h3>", _how("depth"),
             figure_html(figures[1]), "<h3>The cross-model table</h3>", _how("table"), cross_model_table_html(table),
             "</section>"]
    return "".join(parts), figures


def write_cross_model_report(run_dir: Path, out: Path, store: str | None = None) -> list[Figure]:
    """The cross-model page, then each model's single-model section, as one self-contained page (atomic)."""
    try:
        document = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError) as exc:
        raise PoolBenchError(f"{run_dir / 'results.json'} cannot be read ({exc})") from None
    if not is_cross_model(document):
        raise PoolBenchError(f"{run_dir / 'results.json'} is no cross-model run")
    body, figures = cross_model_section(document["cross_model"])
    sections = [body]
    runs = [run for model in document["models"] for run in load_runs(run_dir / model["folder"], store)]
    for i, run in enumerate(runs):
        part, run_figures = run_section(run, i)
        sections.append(part)
        figures += run_figures
    page = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>PoolBench report across models"
            f"</title><style>{PAGE_STYLE}</style></head><body><h1>PoolBench report across models</h1>"
            f"{''.join(sections)}</body></html>")
    write_text_atomic(out, page)
    return figures
