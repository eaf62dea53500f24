"""`findings`: a thin CLI shell over poolbench.results.pages.findings (register with `app.command("findings")`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def findings(run_dir: Annotated[Path, typer.Option("--run", help="a finished run's folder")] = Path("runs/default"),
             out: Annotated[Path, typer.Option("--out", help="folder to write findings.md and findings.json into")]
             = Path("docs")) -> None:
    """Write <out>/findings.md (and the values it shows, findings.json) from a run's results: the answer, the
    leaderboard, the lexical baseline and steering against prompting; no number typed by hand."""
    from rich.console import Console

    from poolbench.results.documents.cross_model_outputs import is_cross_model
    from poolbench.results.pages.findings import write_findings

    results = run_dir / "results.json"
    if results.is_file() and is_cross_model(json.loads(results.read_text())):
        from poolbench.results.pages.cross_model_findings import write_cross_model_findings

        page, facts = write_cross_model_findings(run_dir, out)
    else:
        page, facts = write_findings(run_dir, out)
    Console().print(f"wrote {page} and {facts} from {run_dir / 'results.json'}", highlight=False, soft_wrap=True)
