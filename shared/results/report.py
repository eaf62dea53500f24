"""A run's results as one self-contained HTML page a person reads: matplotlib figures inlined as base64 PNG.

Input is what `poolbench-driver run` writes (results.json, leaderboard.json); sections whose data a run does
not carry (D2 α curves, scorer validity) are left out with a note rather than drawn empty.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from poolbench.errors import PoolBenchError
from poolbench.records.base import RecordError
from poolbench.records.d1 import D1CellRecord
from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record
from poolbench.results.leaderboard import PRIMARY_PROBE, build_leaderboard

DPI = 100
_SHOWN_COLUMNS = ("strategy", "family", "mean_d1", "mean_cv_auroc", "best_layer", "win_rate", "average_rank")


@dataclass(frozen=True)
class Figure:
    """One embedded figure: an id the page and the tests refer to, a caption and the PNG bytes."""

    fig_id: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Run:
    """One run folder's documents and their typed records; `name` labels it (the model id) when a report
    covers several runs."""

    name: str
    results: dict
    leaderboard: dict
    cells: list[D1CellRecord]
    d2: list[D2Record]  # those with an α table (a null steering vector has none)
    scorers: list[ScorerValidity]


def load_runs(path: Path) -> list[Run]:
    """A run folder, or a folder of run folders (one per model): every results.json found, one level deep."""
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
            d2, scorers = d2_records(results), scorer_records(results)
        except RecordError as exc:
            raise PoolBenchError(f"{folder / 'results.json'}: {exc}") from None
        board_path = folder / "leaderboard.json"
        board = json.loads(board_path.read_text()) if board_path.is_file() else build_leaderboard(cells)
        runs.append(Run((results.get("model") or {}).get("model_id") or folder.name, results, board, cells, d2,
                        scorers))
    return runs


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


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


def layer_curve_figure(run: Run) -> bytes:
    """Per strategy, mean out-of-fold AUROC over concepts at every layer (the curve the layer is chosen on)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in sorted(run.leaderboard["strategies"], key=lambda r: r["strategy"]):
        curve = {int(k): v for k, v in row["layer_curve"].items()}
        layers = sorted(curve)
        ax.plot(layers, [curve[L] for L in layers], marker="o", label=row["strategy"])
    ax.set_xlabel("layer")
    ax.set_ylabel("mean CV AUROC over concepts")
    ax.set_title(f"Layer curves — {run.name}")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return _png(fig)


def d2_records(results: dict) -> list[D2Record]:
    """D2 records that carry an α table, wherever a run put them (results["d2"] or results["steering"])."""
    found = results.get("d2") or (results.get("steering") or {}).get("d2") or []
    if isinstance(found, dict):
        found = list(found.values())
    records = [D2Record.from_dict(r) for r in found if isinstance(r, dict)]
    return [r for r in records if r.per_alpha]


def alpha_figure(run: Run, records: list[D2Record]) -> bytes:
    """Concept score against steering strength α, one panel per concept, one line per (strategy, layer)."""
    by_concept: dict[str, list[D2Record]] = defaultdict(list)
    for r in records:
        by_concept[r.concept].append(r)
    concepts = sorted(by_concept)
    fig, axes = plt.subplots(1, len(concepts), figsize=(4.2 * len(concepts), 3.6), squeeze=False)
    for ax, concept in zip(axes[0], concepts, strict=True):
        for r in sorted(by_concept[concept], key=lambda r: (r.strategy, r.layer)):
            rows = r.per_alpha or []
            ax.plot([p.alpha for p in rows], [p.score for p in rows], marker="o", label=f"{r.strategy} L{r.layer}")
        ax.set_title(concept)
        ax.set_xlabel("α")
        ax.set_ylabel("mean concept score")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"D2 α curves — {run.name}")
    return _png(fig)


def cd_figure(friedman: dict, name: str) -> bytes:
    """Demšar's critical-difference diagram: average ranks on an axis, strategies closer than CD joined."""
    ranks = dict(sorted(friedman["average_ranks"].items(), key=lambda kv: kv[1]))
    cd, k = float(friedman["critical_difference"]), int(friedman["k"])
    names, values = list(ranks), np.array(list(ranks.values()))
    half = (len(names) + 1) // 2
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.32 * half))
    ax.set_xlim(0.5, k + 0.5)
    ax.set_ylim(-(half + 1.5), 1.6)
    ax.hlines(0, 1, k, color="black")
    for r in range(1, k + 1):
        ax.vlines(r, 0, 0.15, color="black")
        ax.text(r, 0.3, str(r), ha="center", fontsize=8)
    ax.plot([1, 1 + cd], [1.1, 1.1], color="firebrick", lw=2)
    ax.text(1 + cd / 2, 1.25, f"CD = {cd:.2f}", ha="center", fontsize=8, color="firebrick")
    for i, (label, rank) in enumerate(zip(names, values, strict=True)):
        left = i < half
        y = -(i + 1) * 0.7 if left else -(len(names) - i) * 0.7
        x_text = 0.55 if left else k + 0.45
        ax.plot([rank, rank, x_text], [0, y, y], color="dimgray", lw=0.8)
        ax.text(x_text, y + 0.08, f"{label} ({rank:.2f})", ha="left" if left else "right", fontsize=8)
    cliques = []
    for i in range(len(values)):
        j = int(np.searchsorted(values, values[i] + cd, side="right")) - 1
        if j > i and not any(a <= i and j <= b for a, b in cliques):
            cliques.append((i, j))
    for depth, (a, b) in enumerate(cliques, start=1):
        ax.hlines(-0.15 - 0.18 * depth, values[a] - 0.03, values[b] + 0.03, color="black", lw=3)
    ax.axis("off")
    ax.set_title(f"Critical difference (Nemenyi, α = {friedman.get('alpha', 0.05)}) — {name}", fontsize=10)
    return _png(fig)


def fallback_figure(run: Run) -> bytes:
    """Share of passages where a strategy selected no token and fell back to the mean (over all cells)."""
    rates: dict[str, list[float]] = defaultdict(list)
    for cell in run.cells:
        if cell.probe == PRIMARY_PROBE:
            rates[cell.strategy].append(float(cell.fallback_rate))
    strategies = sorted(rates)
    means = [float(np.mean(rates[s])) for s in strategies]
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * len(strategies), 3.6))
    ax.bar(strategies, means, color=["firebrick" if m > 0.5 else "steelblue" for m in means])
    ax.axhline(0.5, color="firebrick", ls="--", lw=1, label="flag threshold (50%)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean fallback rate")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=7)
    ax.set_title(f"Fallback rates — {run.name}")
    return _png(fig)


def scorer_records(results: dict) -> list[ScorerValidity]:
    """Classifier-B validity records (results["scorers"], a list or a dict by concept) that carry an AUROC."""
    found = results.get("scorers") or results.get("scorer_validity") or []
    if isinstance(found, dict):
        found = list(found.values())
    records = [ScorerValidity.from_dict(r) for r in found if isinstance(r, dict)]
    return [r for r in records if r.heldout_auroc is not None]


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
        ax.legend(fontsize=7)
    ax.set_ylim(0.4, 1.02)
    ax.set_ylabel("held-out AUROC")
    ax.tick_params(axis="x", rotation=45)
    ax.set_title(f"Scorer (classifier B) validity — {run.name}")
    return _png(fig)


def run_figures(run: Run, index: int) -> tuple[list[Figure], list[str]]:
    """Every figure this run's data supports, plus a note for each section it cannot fill."""
    tag = f"run{index}"
    figures = [Figure(f"{tag}-heatmap", f"D1 heatmap (concept × strategy) — {run.name}", heatmap_figure(run)),
               Figure(f"{tag}-layers", f"Layer curves per strategy — {run.name}", layer_curve_figure(run))]
    notes = []
    if run.d2:
        figures.append(Figure(f"{tag}-alpha", f"D2 α curves — {run.name}", alpha_figure(run, run.d2)))
    else:
        notes.append("No D2 results in this run: α curves are not drawn.")
    friedman = (run.results.get("reliability") or {}).get("friedman")
    if friedman and friedman.get("average_ranks"):
        figures.append(Figure(f"{tag}-cd", f"Critical-difference diagram — {run.name}", cd_figure(friedman, run.name)))
    else:
        reason = (run.results.get("reliability") or {}).get("skipped", "no Friedman test in results.json")
        notes.append(f"No critical-difference diagram: {reason}.")
    figures.append(Figure(f"{tag}-fallback", f"Fallback rates — {run.name}", fallback_figure(run)))
    if run.scorers:
        figures.append(Figure(f"{tag}-scorer", f"Scorer validity — {run.name}", scorer_figure(run, run.scorers)))
    else:
        notes.append("No scorer (classifier B) records in this run: validity is not drawn.")
    return figures, notes


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "—" if value is None else str(value)


def reliability_table(run: Run) -> str:
    """The leaderboard's per-strategy columns, including any reliability columns the run added."""
    rows = run.leaderboard["strategies"]
    extra = sorted({k for r in rows for k, v in r.items()
                    if k not in _SHOWN_COLUMNS and isinstance(v, (int, float)) and not isinstance(v, bool)})
    columns = [c for c in _SHOWN_COLUMNS if any(c in r for r in rows)] + extra
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in sorted(rows, key=lambda r: -r["mean_d1"]))
    return f'<table class="reliability"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
figure{margin:1.5em 0}img{display:block;max-width:100%;height:auto}figcaption{font-size:.9em;color:#555}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
.note{color:#8a5a00}"""


def render_report(runs: list[Run]) -> tuple[str, list[Figure]]:
    """The HTML page and the figures in it (each <img> carries data-figure=<fig_id>)."""
    parts, all_figures = [], []
    for i, run in enumerate(runs):
        figures, notes = run_figures(run, i)
        all_figures += figures
        res = run.results
        meta = (f"model {html.escape(run.name)} · corpus {html.escape(str(res.get('corpus', {}).get('hash', ''))[:12])}"
                f" · git {html.escape(str(res.get('git_hash', ''))[:10])} · {html.escape(str(res.get('date', '')))}")
        parts.append(f"<section><h2>{html.escape(run.name)}</h2><p>{meta}</p>")
        parts.append("<h3>Leaderboard and reliability</h3>" + reliability_table(run))
        for fig in figures:
            data = base64.b64encode(fig.png).decode("ascii")
            parts.append(f'<figure><img data-figure="{fig.fig_id}" alt="{html.escape(fig.caption)}" '
                         f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.caption)}</figcaption>'
                         "</figure>")
        parts += [f'<p class="note">{html.escape(n)}</p>' for n in notes]
        parts.append("</section>")
    page = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>PoolBench report</title>"
            f"<style>{_STYLE}</style></head><body><h1>PoolBench report</h1>{''.join(parts)}</body></html>")
    return page, all_figures


def write_report(run_dir: Path, out: Path) -> list[Figure]:
    """Render the report for `run_dir` into `out` (written whole, then renamed)."""
    page, figures = render_report(load_runs(run_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return figures
