"""`validate-steerability` (`make run-steerability`): a thin shell over driver.steerability_validation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from poolbench.atomic_write import write_json_atomic, write_text_atomic
from poolbench.defaults import EMBEDDED, default_store_url
from poolbench.errors import PoolBenchError


def validate_steerability(
    model: Annotated[str, typer.Option(help="HF id/path, or 'embedded'")] = EMBEDDED,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    concepts: Annotated[str | None, typer.Option(help="concepts (comma list); default the corpus's first 3")] = None,
    n_concepts: Annotated[int, typer.Option(help="how many concepts when --concepts is not given")] = 3,
    alpha: Annotated[float, typer.Option(help="alpha of the exact log-likelihood shift")] = 0.1,
    layer: Annotated[int | None, typer.Option(help="every strategy at this layer")] = None,
    leaderboard: Annotated[Path | None, typer.Option(help="a run's leaderboard.json: chosen layers")] = None,
    d2: Annotated[bool, typer.Option(help="generation-based D2 on every cell")] = True,
    d2_alphas: Annotated[str, typer.Option(help="D2's alpha grid (comma list)")] = "0,0.1,0.2,0.4",
    n_prompts: Annotated[int, typer.Option(help="D2 prompts per alpha")] = 20,
    max_new_tokens: Annotated[int, typer.Option(help="D2 tokens generated per prompt")] = 32,
    budget_minutes: Annotated[float | None, typer.Option(
        help="start no concept that would end past this many minutes (the page says which ran)")] = None,
    backend: Annotated[str, typer.Option(help="steering backend for D2: vllm or transformers")] = "vllm",
    allow_weak_scorer: Annotated[bool, typer.Option(help="keep scorers with held-out AUROC < 0.7")] = False,
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    out: Annotated[Path, typer.Option(help="folder for steerability.json")] = Path("runs/steerability"),
    page: Annotated[Path | None, typer.Option(help="the findings page to write")] = Path("docs/steerability.md"),
) -> None:
    """Validate first-order steerability against the exact log-likelihood shift and generation-based D2."""
    from poolbench.driver.steerability_stage import validation_key
    from poolbench.driver.steerability_validation import ValidationSettings, run_validation
    from poolbench.results.pages.steerability_page import steerability_page
    from poolbench.store.url import open_store

    try:
        grid = tuple(float(a) for a in d2_alphas.split(",") if a.strip())
    except ValueError as exc:
        raise PoolBenchError(f"--d2-alphas '{d2_alphas}' is not a comma list of numbers") from exc
    settings = ValidationSettings(concepts=tuple(concepts.split(",")) if concepts else None, n_concepts=n_concepts,
                                  alpha=alpha, layer=layer, leaderboard=leaderboard, d2=d2, d2_alphas=grid,
                                  n_prompts=n_prompts, max_new_tokens=max_new_tokens, backend=backend,
                                  allow_weak_scorer=allow_weak_scorer,
                                  budget_s=None if budget_minutes is None else 60 * budget_minutes)
    store_url = store or default_store_url()
    run = run_validation(model, corpus, corpus_size, store_url, settings, on_line=typer.echo)
    record = run.to_record()
    open_store(store_url).put_json(validation_key(run.weights_hash), record)
    write_json_atomic(out / "steerability.json", record)
    if page is not None:
        write_text_atomic(page, steerability_page(record))
    typer.echo(run.verdict.sentence())
