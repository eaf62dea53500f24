"""`steer`, `train-scorers` and `serve-scorers`: thin CLI shells over poolbench.steerer / poolbench.scorer.

Register with `app.command("steer")(steer)` etc.; errors are PoolBenchErrors (one line, non-zero exit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from poolbench.atomic_write import write_json_atomic
from poolbench.cli.options import out_folder
from poolbench.defaults import EMBEDDED, default_store_url
from poolbench.errors import PoolBenchError

console = Console()


def _alphas(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(a) for a in text.split(",") if a.strip())
    except ValueError as exc:
        raise PoolBenchError(f"--alphas '{text}' is not a comma list of numbers") from exc


def _fmt(value: object) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def _store_url(store: str | None) -> str:
    return store or default_store_url()


def train_scorers(
    concepts: Annotated[str | None, typer.Option(help="concepts (comma list); default all")] = None,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    encoder: Annotated[str | None, typer.Option(help="HF encoder id/path (default: bundled all-MiniLM-L6-v2)")] = None,
    allow_weak_scorer: Annotated[bool, typer.Option(help="keep scorers with held-out AUROC < 0.7")] = False,
) -> None:
    """Fine-tune (or fetch) classifier B per concept and print its held-out accuracy and AUROC."""
    from poolbench.corpus.source import open_corpus
    from poolbench.scorer.artifacts import ensure_scorers, scorer_record
    from poolbench.scorer.finetune import ScorerConfig
    from poolbench.store.url import open_store

    source = open_corpus(corpus, corpus_size, concepts.split(",") if concepts else None)
    scorers = ensure_scorers(open_store(_store_url(store)), source, source.concepts,
                             ScorerConfig(encoder=encoder) if encoder else None, allow_weak=allow_weak_scorer)
    table = Table("concept", "held-out acc", "held-out AUROC", "95% CI", "valid", "train s")
    for s in scorers.values():
        r = scorer_record(s)
        table.add_row(r.concept, _fmt(r.heldout_accuracy), _fmt(r.heldout_auroc),
                      f"{_fmt(r.heldout_auroc_ci_low)}–{_fmt(r.heldout_auroc_ci_high)}", str(r.valid),
                      _fmt(r.train_seconds))
    console.print(table)


def steer(
    concept: Annotated[str, typer.Option(help="the concept to steer toward")],
    strategy: Annotated[str, typer.Option(help="pooling strategy id whose DiffMean vector steers")],
    layer: Annotated[int, typer.Option(help="decoder layer whose output is steered")],
    model: Annotated[str, typer.Option(help="HF id or local path; 'embedded' is the built-in model")] = EMBEDDED,
    alphas: Annotated[str | None, typer.Option(help="alpha grid in residual-norm units")] = None,
    prompts: Annotated[Path | None, typer.Option(help="prompts file, one per line (default: shipped 50)")] = None,
    n_prompts: Annotated[int | None, typer.Option(help="use the first N prompts")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per prompt")] = 32,
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = 0.7,
    greedy: Annotated[bool, typer.Option(help="greedy decoding instead of seeded sampling")] = False,
    backend: Annotated[str, typer.Option(help="transformers or vllm")] = "transformers",
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    allow_weak_scorer: Annotated[bool, typer.Option(help="keep scorers with held-out AUROC < 0.7")] = False,
    fluency_guard: Annotated[float, typer.Option(help="max perplexity ratio to alpha = 0 for alpha*")] = 2.0,
    reference_model: Annotated[str, typer.Option(
        help="the model that judges fluency: auto (the other embedded model), self (the steered model) or a model "
             "reference as --model takes")] = "auto",
    seed: Annotated[int, typer.Option(help="seed for prompt seeds, halves and bootstrap")] = 0,
    prompt_format: Annotated[str, typer.Option(help="auto (chat template if the tokenizer has one), chat, plain")]
        = "auto",
    out: Annotated[Path, typer.Option(help="folder for steer.json (D2/D3)")] = Path("runs/steer"),
) -> None:
    """D2 and D3 for one (concept, strategy, layer) cell: steer, score, and print SCP, Delta, Disent."""
    from poolbench.steerer.backend import GenerationSettings
    from poolbench.steerer.single_cell import steer_one_cell

    result = steer_one_cell(
        concept, strategy, layer, model=model, corpus=corpus, corpus_size=corpus_size, store_url=_store_url(store),
        alphas=_alphas(alphas), n_prompts=n_prompts, prompts_file=str(prompts) if prompts else None,
        settings=GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy),
        fluency_guard=fluency_guard, seed=seed, backend=backend, allow_weak_scorer=allow_weak_scorer,
        prompt_format=prompt_format, reference_model=reference_model)
    d2 = result.d2
    table = Table("alpha", "score", "fluency ratio", "relevance", title=f"{concept} · {d2.strategy} · layer {layer}")
    for row in d2.per_alpha or []:
        table.add_row(_fmt(row.alpha), _fmt(row.score), _fmt(row.fluency_ratio), _fmt(row.relevance))
    console.print(table)
    console.print(f"SCP {_fmt(d2.scp)} [{_fmt(d2.scp_ci_low)}, {_fmt(d2.scp_ci_high)}]  "
                  f"alpha* {_fmt(d2.alpha_star)}  Delta {_fmt(d2.d2_delta)} "
                  f"[{_fmt(d2.d2_delta_ci_low)}, {_fmt(d2.d2_delta_ci_high)}]  "
                  f"prompted Delta {_fmt(d2.prompted_delta)}"
                  + (f"  null: {d2.null_reason}" if d2.null_reason else ""))
    for r in result.d3:
        console.print(f"D3 {r.relation} {r.neighbour}: Disent {_fmt(r.disent)} "
                      f"(raw {_fmt(r.disent_raw)}) rep {_fmt(r.d3_rep)}"
                      + (f"  null: {r.disent_null_reason}" if r.disent_null_reason else ""))
    target = out_folder(out) / "steer.json"
    write_json_atomic(target, result.to_dict())
    console.print(f"wrote {target}")


def serve_scorers(
    concepts: Annotated[str | None, typer.Option(help="concepts (comma list); default all")] = None,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    run: Annotated[Path | None, typer.Option(help="serve the scorers this run folder recorded (no training)")] = None,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    allow_weak_scorer: Annotated[bool, typer.Option(help="serve scorers with held-out AUROC < 0.7")] = False,
    token: Annotated[str | None, typer.Option(
        envvar="POOLBENCH_TOKEN", show_envvar=True,
        help="bearer token every request but /healthz must carry (>= 16 characters); needed beyond loopback")]
    = None,
) -> None:
    """Serve POST /score {concept, texts} (the one PoolBench HTTP app, no LM) on host:port until interrupted."""
    import time

    from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray
    from poolbench.http.access import check_exposure, with_token
    from poolbench.http.app import start_serve
    from poolbench.http.settings import ServiceSettings, scorers_of_run
    from poolbench.store.url import open_store

    check_exposure(host, with_token(ServiceSettings(models=()), token).token)  # before any scorer trains
    if run is not None:
        from poolbench.http.leaderboard_route import leaderboard_of_run

        settings = ServiceSettings(models=(), **scorers_of_run(run), **leaderboard_of_run(run))
    else:
        from poolbench.corpus.source import open_corpus
        from poolbench.scorer.artifacts import ensure_scorers

        url_store = _store_url(store)
        source = open_corpus(corpus, corpus_size, concepts.split(",") if concepts else None)
        scorers = ensure_scorers(open_store(url_store), source, source.concepts, allow_weak=allow_weak_scorer)
        settings = ServiceSettings(models=(), scorer_store=url_store,
                                   scorer_keys={c: s.info["key"] for c, s in scorers.items()})
    settings = with_token(settings, token)
    init_local_ray(log_to_driver=True, runtime_env=LOOPBACK_RUNTIME_ENV)
    url = start_serve(settings, host=host, port=port)
    console.print(f"serving POST {url}/score for {', '.join(settings.scorer_concepts)}")
    while True:
        time.sleep(3600)
