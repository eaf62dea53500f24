"""`report`: a thin CLI shell over poolbench.results.pages.report (register with `app.command("report")(report)`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from poolbench.cli.options import DEFAULT_RUN


def report_target(html: Path | None, run_dir: Path) -> Path:
    """`--html` is a folder that gets report.html (default: the run folder); a path ending in .html is the page."""
    folder = run_dir if html is None else html
    return folder if folder.suffix == ".html" else folder / "report.html"


def report(run: Annotated[Path, typer.Option(help="a run's --out folder, or a folder of run folders")] = DEFAULT_RUN,
           html: Annotated[Path | None, typer.Option(
               "--html", help="folder to write report.html into", show_default="the run folder")] = None,
           store: Annotated[str | None, typer.Option(
               help="where the runs' generations are (default: the store each run recorded); gives the D2 "
                    "per-alpha intervals")] = None) -> None:
    """Write a self-contained HTML report: run summary, leaderboard with CIs and verdicts, CD diagram, D1 heatmap,
    layer curves, fallback cells, per-concept D1, D2/D3 tables and alpha curves, scorer validity, strategy
    definitions."""
    from rich.console import Console

    from poolbench.results.documents.cross_model_outputs import is_cross_model
    from poolbench.results.pages.report import write_report

    target = report_target(html, run)
    if (run / "results.json").is_file() and is_cross_model(json.loads((run / "results.json").read_text())):
        from poolbench.results.pages.cross_model_report import write_cross_model_report

        figures = write_cross_model_report(run, target, store)
    else:
        figures = write_report(run, target, store)
    Console().print(f"wrote {target} ({len(figures)} figures: {', '.join(f.fig_id for f in figures)})")
