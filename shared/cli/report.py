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
               "report.html")) -> None:
    """Write a self-contained HTML report (D1 heatmap, layer curves, D2 α curves, CD diagram, fallbacks)."""
    figures = write_report(run_dir, html)
    console.print(f"wrote {html} ({len(figures)} figures: {', '.join(f.fig_id for f in figures)})")
