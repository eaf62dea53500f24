"""`report`: a thin CLI shell over poolbench.results.report (register with `app.command("report")(report)`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from poolbench.results.report import write_report

console = Console()


def report(run_dir: Annotated[Path, typer.Argument(help="a run's --out folder, or a folder of run folders")],
           html: Annotated[Path, typer.Option("--html", help="where to write the self-contained page")] = Path(
               "report.html"),
           store: Annotated[str | None, typer.Option(
               help="where the runs' generations are (default: the store each run recorded); gives the D2 "
                    "per-alpha intervals")] = None) -> None:
    """Write a self-contained HTML report: run summary, leaderboard with CIs and tie groups, CD diagram, D1 heatmap,
    layer curves, fallback cells, per-concept D1, D2/D3 tables and alpha curves, scorer validity, strategy
    definitions."""
    figures = write_report(run_dir, html, store)
    console.print(f"wrote {html} ({len(figures)} figures: {', '.join(f.fig_id for f in figures)})")
