"""`capability`: what steering a run's cell costs on an lm-evaluation-harness task, scored through the service's
OpenAI-compatible endpoint at alpha* and at alpha = 0; the record goes into the run folder's capability.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from poolbench.cli.options import DEFAULT_RUN

console = Console()


def capability(
    task: Annotated[str, typer.Option(help="lm-eval task name (a YAML in --task-dir, or a built-in task)")],
    task_dir: Annotated[Path, typer.Option(help="folder of task YAMLs and their local data (read offline)")],
    concept: Annotated[str, typer.Option(help="the steered concept")],
    strategy: Annotated[str, typer.Option(help="pooling strategy id or short code")],
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
    layer: Annotated[int | None, typer.Option(help="default: the layer the run steered the cell at")] = None,
    alpha: Annotated[float | None, typer.Option(help="default: the cell's alpha*")] = None,
    metric: Annotated[str, typer.Option(help="the task's per-document metric")] = "acc",
    limit: Annotated[int | None, typer.Option(help="first N documents")] = None,
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples of the paired difference")] = 2000,
    seed: Annotated[int, typer.Option(help="bootstrap seed")] = 0,
) -> None:
    """Score a task at alpha* and alpha = 0 through /v1/completions (lm-eval local-completions) on a loopback
    service; print and record the difference with its 95% interval (capability.json, results.json, answer.json)."""
    from poolbench.capability.measure import CapabilityError
    from poolbench.capability.records import record_capability, record_sentence
    from poolbench.capability.stage import measure_run_capability
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.results.exports.vector_export import choose_layer, read_run

    doc = read_run(run_dir)
    strategy = resolve_strategies([strategy])[0].id
    layer = choose_layer(doc, run_dir, concept, strategy, layer)
    cells = [r for r in doc.get("d2") or [] if (r.get("concept"), r.get("strategy"), r.get("layer"))
             == (concept, strategy, layer)]
    if alpha is None:
        alpha = cells[0].get("alpha_star") if cells else None
        if not alpha:
            raise CapabilityError(f"--alpha: {run_dir} has no alpha* > 0 for {concept}/{strategy}/L{layer}; give one")
    (record,) = measure_run_capability(run_dir, doc, [(concept, strategy, layer, float(alpha))], task, task_dir,
                                       metric=metric, limit=limit, n_bootstrap=n_bootstrap, seed=seed)
    record_capability(run_dir, [record])
    console.print(f"{record_sentence(record.to_dict())} Wrote {run_dir / 'capability.json'}", soft_wrap=True,
                  highlight=False, markup=False)

