"""A run's results as one self-contained HTML page a person reads: matplotlib figures inlined as base64 PNG.

The page puts the parts in reading order, each with a note on how to read it: the runs it reads
(report_runs), the figures (report_figures) and the tables (report_tables); a section whose data a run does
not carry says so in a note rather than being drawn empty.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path

from poolbench.atomic_write import write_text_atomic
from poolbench.results.answer.answer import answer_html, build_answer
from poolbench.results.answer.axes import axes_html
from poolbench.results.answer.leaderboard import ranked_on_text
from poolbench.results.pages.report_figures import (
    alpha_figure,
    bucket_figure,
    cd_figure,
    fallback_figure,
    heatmap_figure,
    layer_curve_figure,
    scorer_figure,
)
from poolbench.results.pages.report_runs import Run, friedman_of, load_runs
from poolbench.results.pages.report_tables import (
    bucket_table,
    d2_summary,
    d2_table,
    d3_table,
    friedman_html,
    leaderboard_table,
    lexical_table,
    per_concept_html,
    run_summary,
    scorer_table,
    strategy_table,
    tier_tables,
)


@dataclass(frozen=True)
class Figure:
    """One embedded figure: an id the page and the tests refer to, a caption and the PNG bytes."""

    fig_id: str
    caption: str
    png: bytes


HOW_TO_READ = {
    "summary": "What ran: the model, the layers probed, how many passages every D1 cell saw, how the statistics "
               "were drawn and how long it took.",
    "leaderboard": "Strategies in the order the line above names: D1_mix, the declared tier estimand "
                   "(docs/tiers.md), where the run has both tiers, else mean D1. Mean D1 is the held-out test AUROC "
                   "at each strategy's layer (chosen on training CV, never on the test split), averaged over "
                   "concepts; its 95% CI is a t-interval over concepts. <b>rank</b> orders the ranked value. "
                   "<b>avg rank</b> is the Friedman average rank over "
                   "the concepts, each strategy at its chosen layer (the blocks the Friedman line names). "
                   "<b>verdict</b> is the strategy's against the best chosen on mean CV AUROC (the Answer above "
                   "names each test: Wilcoxon signed-rank with Holm's step-down, the Bayesian signed-rank test "
                   "with a ROPE). Seed σ (spread of CV AUROC over fold shuffles), selectivity (CV AUROC "
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
    "axes": "Sites: each strategy's mean held-out D1 [95% t-interval over concepts] at the layer chosen on training "
            "CV at that site (block output, attention or MLP sub-block output). Context length: each test passage "
            "read inside k x its length of neutral text, probes trained at length 1, at the layer the leaderboard "
            "chose; the change is D1(k) - D1(1) per concept, loses where its interval lies below 0.",
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

PAGE_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1500px;color:#222}
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


def figure_html(fig: Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (f'<figure><img data-figure="{fig.fig_id}" alt="{html.escape(fig.caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(fig.caption)}</figcaption></figure>')


def run_section(run: Run, index: int) -> tuple[str, list[Figure]]:
    """One run's part of the page, in reading order, and its figures."""
    tag, figures, parts = f"run{index}", [], []

    def figure(suffix: str, caption: str, png: bytes) -> None:
        fig = Figure(f"{tag}-{suffix}", f"{caption} — {run.name}", png)
        figures.append(fig)
        parts.append(figure_html(fig))

    def note(text: str) -> None:
        parts.append(f'<p class="note">{html.escape(text)}</p>')

    answer = run.answer or build_answer(run.results, run.leaderboard)
    parts += [f"<section><h2>{html.escape(run.name)}</h2>", answer_html(answer),
              "<h3>Run summary</h3>", _how("summary"),
              run_summary(run), "<h3>Leaderboard</h3>",
              f'<p class="ranked-on">{html.escape(ranked_on_text(run.leaderboard).capitalize())}.</p>',
              _how("leaderboard"), friedman_html(run),
              leaderboard_table(run)]
    friedman = friedman_of(run)
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
    if run.leaderboard.get("sites") or run.leaderboard.get("context_lengths"):
        parts += ["<h3>D1 by activation site and context length</h3>", _how("axes"), axes_html(run.leaderboard)]
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
            f"<style>{PAGE_STYLE}</style></head><body><h1>PoolBench report</h1>{''.join(sections)}</body></html>")
    return page, all_figures


def write_report(run_dir: Path, out: Path, store: str | None = None) -> list[Figure]:
    """Render the report for `run_dir` into `out` (written whole, then renamed)."""
    page, figures = render_report(load_runs(run_dir, store))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, page)
    return figures
