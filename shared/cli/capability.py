"""`capability`: what steering a run's cell costs on an lm-evaluation-harness task, scored through the service's
OpenAI-compatible endpoint at alpha* and at alpha = 0; the record goes into the run folder's capability.json."""

from __future__ import annotations

import json
import secrets
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
    service; print and record the difference with its 95% interval."""
    from poolbench.atomic_write import write_json_atomic
    from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray
    from poolbench.extractor.loading import local_model_dir
    from poolbench.http.app import start_serve
    from poolbench.http.settings import ServiceSettings, vectors_of_run
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.results.capability import CapabilityError, measure_capability
    from poolbench.results.vector_export import choose_layer, read_run

    doc = read_run(run_dir)
    strategy = resolve_strategies([strategy])[0].id
    layer = choose_layer(doc, run_dir, concept, strategy, layer)
    cells = [r for r in doc.get("d2") or [] if (r.get("concept"), r.get("strategy"), r.get("layer"))
             == (concept, strategy, layer)]
    if alpha is None:
        alpha = cells[0].get("alpha_star") if cells else None
        if not alpha:
            raise CapabilityError(f"--alpha: {run_dir} has no alpha* > 0 for {concept}/{strategy}/L{layer}; give one")
    model = str((doc.get("config") or {}).get("model") or "")
    tokenizer = local_model_dir(model)
    if not model or tokenizer is None:
        raise CapabilityError(f"{run_dir}/results.json: config.model '{model}' is not a local model lm-eval can "
                              "tokenize with")
    import socket

    from ray import serve

    with socket.socket() as probe:  # a free loopback port for the service this command starts and stops
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = secrets.token_hex(16)
    settings = ServiceSettings(models=(model,), token=token, **vectors_of_run(run_dir))
    import ray

    if not ray.is_initialized():
        init_local_ray(runtime_env=LOOPBACK_RUNTIME_ENV)
    base = start_serve(settings, port=port)
    try:
        record = measure_capability(base, model, str(tokenizer), task, task_dir, concept=concept, strategy=strategy,
                                    layer=layer, alpha=float(alpha), metric=metric, token=token, limit=limit,
                                    n_bootstrap=n_bootstrap, seed=seed)
    finally:
        serve.shutdown()
    target = run_dir / "capability.json"
    kept = json.loads(target.read_text()) if target.is_file() else []
    key = (record.task, record.concept, record.strategy, record.layer, record.alpha)
    kept = [r for r in kept if (r["task"], r["concept"], r["strategy"], r["layer"], r["alpha"]) != key]
    write_json_atomic(target, [*kept, record.to_dict()])
    console.print(f"{task} {metric}: {record.score_unsteered:.3f} at alpha = 0, {record.score_steered:.3f} at alpha "
                  f"{record.alpha:g}; difference {record.difference:+.3f} [{record.ci_low:+.3f}, "
                  f"{record.ci_high:+.3f}] over {record.n_docs} documents; wrote {target}")
