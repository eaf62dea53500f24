"""The cross-model table a run over several models prints: strategy × model D1 with intervals, ranks and relative
depth, then the answer in sentences (best in every model, best on average, Kendall's W)."""

from __future__ import annotations

from rich.table import Table


def _cell(cell: dict) -> str:
    interval = "" if cell["ci_low"] is None else f" [{cell['ci_low']:.3f}, {cell['ci_high']:.3f}]"
    rank = f"{cell['rank']:g}"
    return f"{cell['mean_d1']:.3f}{interval} #{rank} L{cell['best_layer']} ({cell['relative_depth']:.2f})"


def cross_model_board(table: dict) -> Table:
    """One row per strategy in mean-rank order; per model: mean D1 [95% CI], #rank, layer (relative depth)."""
    models = [m["name"] for m in table["models"]]
    view = Table(title=f"Cross-model D1 ({len(models)} models, {len(table['concepts'])} shared concepts)",
                 caption="per model: mean held-out D1 over the shared concepts [95% t-interval over concepts], "
                         "#rank within the model (ties share the average rank), CV-chosen layer (relative depth "
                         "layer/(n_layers-1))", caption_justify="left")
    view.add_column("mean rank", justify="right")
    view.add_column("strategy")
    for model in models:
        view.add_column(model)
    for row in table["rows"]:
        view.add_row(f"{row['mean_rank']:.1f}", row["strategy"], *(_cell(row["per_model"][m]) for m in models))
    return view


def cross_model_answer(table: dict) -> str:
    return "\n".join(table["answer"])
