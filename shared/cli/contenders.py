"""`learning-curve` and `contenders`: thin CLI shells over poolbench.api.evaluate_learning_curve and
poolbench.results.pages.contenders (registered in app.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from poolbench.defaults import EMBEDDED
from poolbench.errors import PoolBenchError

CURVE_CONCEPTS = "academic_tone,hedging,toxicity"


def _sizes(text: str) -> list[int | None]:
    """'10,20,all' -> [10, 20, None]: at most N train passages per class; 'all' the whole train split."""
    sizes: list[int | None] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "all":
            sizes.append(None)
        elif item.isdigit() and int(item) >= 4:
            sizes.append(int(item))
        else:
            raise PoolBenchError(f"--sizes: {item!r} is neither a whole number >= 4 nor 'all'")
    if not sizes:
        raise PoolBenchError("--sizes: name at least one size")
    return sizes


def learning_curve(
    model: Annotated[str, typer.Option(help="HF id or local path; 'embedded' is the built-in model")] = EMBEDDED,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "full",
    concepts: Annotated[str, typer.Option(help="3-5 concepts (comma list)")] = CURVE_CONCEPTS,
    strategies: Annotated[str | None, typer.Option(help="strategy ids (comma list); default all")] = None,
    layers: Annotated[str | None, typer.Option(help="layer indices (comma list); default as run")] = None,
    sizes: Annotated[str, typer.Option(
        help="training sizes: at most N train passages per class (pairs whole), 'all' the whole train split")]
    = "10,20,40,all",
    test_limit: Annotated[int | None, typer.Option(
        help="at most N test passages per class (pairs whole), the same at every size; default the whole split")]
    = None,
    seed: Annotated[int, typer.Option(help="seed for folds, probes and bootstrap")] = 0,
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples for CIs")] = 1000,
    reliability: Annotated[bool, typer.Option(help="seed spread, selectivity and MDL for every cell")] = False,
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    out: Annotated[Path, typer.Option(help="folder: one run folder per size and learning_curve.json")]
    = Path("runs/learning-curve"),
) -> None:
    """D1 against training size: one run per size on the same held-out test split (no steering), then per
    learned aggregator the size from which it is ahead of the card's best (the answer's verdicts)."""
    from rich.console import Console

    from poolbench.api import evaluate_learning_curve
    from poolbench.cli.run_display import RunDisplay, run_progress
    from poolbench.config import RunConfig
    from poolbench.results.answer.learning_curve import curve_sentences

    try:
        layer_list = tuple(int(x) for x in layers.split(",")) if layers else None
    except ValueError:
        raise PoolBenchError(f"--layers: {layers} is not a comma list of layer indices") from None
    names = tuple(c.strip() for c in concepts.split(",") if c.strip())
    if not 2 <= len(names) <= 8:
        raise PoolBenchError(f"--concepts: {len(names)} named; a learning curve reads 3-5 concepts")
    cfg = RunConfig(model=model, corpus=corpus, corpus_size=corpus_size, concepts=names,  # type: ignore[arg-type]
                    strategies=tuple(s.strip() for s in strategies.split(",")) if strategies else None,
                    layers=layer_list, seed=seed, test_limit=test_limit,
                    n_bootstrap=n_bootstrap, reliability=reliability, steering=False, store=store, out=str(out))
    console = Console()
    with run_progress(console) as progress:  # one run per size: each shows its plan line and its bars
        curve, path = evaluate_learning_curve(cfg, _sizes(sizes), on_event=RunDisplay(progress).show)
    for line in curve_sentences(curve):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"wrote {path}", highlight=False)


def contenders(
    run_dir: Annotated[Path, typer.Option("--run", help="the contenders run's folder")] = Path("runs/default"),
    curve: Annotated[Path | None, typer.Option(help="a learning-curve folder (its learning_curve.json)")] = None,
    axes_run: Annotated[Path | None, typer.Option(
        help="a run with --sites / --context-lengths to read those sections from; default --run itself")] = None,
    out: Annotated[Path, typer.Option("--out", help="folder to write contenders.md into")] = Path("docs"),
) -> None:
    """Write <out>/contenders.md from a run's results (the learned aggregators against the card's best), a run with
    other sites and context lengths (the same run, or a smaller one) and a learning curve; no number typed by
    hand."""
    from rich.console import Console

    from poolbench.results.pages.contenders import write_contenders

    page = write_contenders(run_dir, curve, out, axes_dir=axes_run)
    Console().print(f"wrote {page} from {run_dir / 'results.json'}", highlight=False, soft_wrap=True)
