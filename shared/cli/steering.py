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
from poolbench.config import EMBEDDED, cache_dir
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


def _scorers(store, corpus, concepts, encoder: str | None, allow_weak: bool) -> dict:
    from poolbench.scorer.artifacts import ensure_scorer
    from poolbench.scorer.finetune import ScorerConfig

    config = ScorerConfig(encoder=encoder) if encoder else ScorerConfig()
    return {c: ensure_scorer(store, c, corpus.passages(c), corpus.concept_hash(c), config, allow_weak=allow_weak)
            for c in concepts}


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
    from poolbench.scorer.artifacts import scorer_record
    from poolbench.store.url import open_store

    source = open_corpus(corpus, corpus_size, concepts.split(",") if concepts else None)
    scorers = _scorers(open_store(store or str(cache_dir() / "store")), source, source.concepts, encoder,
                       allow_weak_scorer)
    table = Table("concept", "held-out acc", "held-out AUROC", "95% CI", "valid", "train s")
    for s in scorers.values():
        r = scorer_record(s)
        table.add_row(r["concept"], _fmt(r["heldout_accuracy"]), _fmt(r["heldout_auroc"]),
                      f"{r['heldout_auroc_ci_low']:.3f}–{r['heldout_auroc_ci_high']:.3f}", str(r["valid"]),
                      _fmt(r["train_seconds"]))
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
    seed: Annotated[int, typer.Option(help="seed for prompt seeds, halves and bootstrap")] = 0,
    prompt_format: Annotated[str, typer.Option(help="auto (chat template if the tokenizer has one), chat, plain")]
        = "auto",
    out: Annotated[Path, typer.Option(help="where the D2/D3 JSON goes")] = Path("runs/steer.json"),
) -> None:
    """D2 and D3 for one (concept, strategy, layer) cell: steer, score, and print SCP, Delta, Disent."""
    from poolbench.corpus.source import open_corpus
    from poolbench.pooler.concept_pooling import pool_concept
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.steerer.backend import GenerationSettings
    from poolbench.steerer.d3 import neighbours
    from poolbench.steerer.run import SteeringConfig, run_steering
    from poolbench.steerer.vector import validate_alphas
    from poolbench.steerer.worker import SteeringWorker
    from poolbench.store.url import open_store

    grid = validate_alphas(_alphas(alphas))
    spec = resolve_strategies([strategy])
    nbrs = neighbours(concept)
    source = open_corpus(corpus, corpus_size)
    if concept not in source.concepts:
        raise PoolBenchError(f"concept '{concept}' is not in corpus {corpus} (has: {', '.join(source.concepts)})")
    concepts = [concept] + [c for c in nbrs.values() if c in source.concepts]
    config = SteeringConfig(alphas=grid, n_prompts=n_prompts, prompts_file=str(prompts) if prompts else None,
                            settings=GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature,
                                                        greedy=greedy),
                            fluency_guard=fluency_guard, seed=seed, prompt_format=prompt_format)
    from poolbench.steerer.prompts import load_prompts

    load_prompts(config.prompts_file, config.n_prompts)  # fail on a bad prompts file before any work
    artifacts = open_store(store or str(cache_dir() / "store"))
    scorers = _scorers(artifacts, source, concepts, None, allow_weak_scorer)
    worker = SteeringWorker(model, backend=backend)
    tables = {c: pool_concept(worker.loaded, source.passages(c), [layer], spec) for c in concepts}
    result = run_steering(artifacts, worker, concept, spec[0].id, layer, tables[concept], scorers, config,
                          train_texts=[p.text for p in source.passages(concept, "train")],
                          neighbour_tables=tables)
    d2 = result["d2"]
    table = Table("alpha", "score", "fluency ratio", "relevance", title=f"{concept} · {spec[0].id} · layer {layer}")
    for row in d2.get("per_alpha", []):
        table.add_row(_fmt(row["alpha"]), _fmt(row["score"]), _fmt(row["fluency_ratio"]), _fmt(row["relevance"]))
    console.print(table)
    console.print(f"SCP {_fmt(d2.get('scp'))} [{_fmt(d2.get('scp_ci_low'))}, {_fmt(d2.get('scp_ci_high'))}]  "
                  f"alpha* {_fmt(d2.get('alpha_star'))}  Delta {_fmt(d2.get('d2_delta'))} "
                  f"[{_fmt(d2.get('d2_delta_ci_low'))}, {_fmt(d2.get('d2_delta_ci_high'))}]  "
                  f"prompted Delta {_fmt(d2.get('prompted_delta'))}"
                  + (f"  null: {d2['null_reason']}" if d2.get("null_reason") else ""))
    for r in result["d3"]:
        console.print(f"D3 {r['relation']} {r['neighbour']}: Disent {_fmt(r.get('disent'))} "
                      f"(raw {_fmt(r.get('disent_raw'))}) rep {_fmt(r.get('d3_rep'))}"
                      + (f"  null: {r['disent_null_reason']}" if r.get("disent_null_reason") else ""))
    write_json_atomic(out, result)
    console.print(f"wrote {out}")


def serve_scorers(
    concepts: Annotated[str | None, typer.Option(help="concepts (comma list); default all")] = None,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    allow_weak_scorer: Annotated[bool, typer.Option(help="serve scorers with held-out AUROC < 0.7")] = False,
) -> None:
    """Serve POST /score {concept, texts} on host:port until interrupted."""
    import time

    import ray

    from poolbench.corpus.source import open_corpus
    from poolbench.http.scorer_app import start_service
    from poolbench.store.url import open_store

    url_store = store or str(cache_dir() / "store")
    source = open_corpus(corpus, corpus_size, concepts.split(",") if concepts else None)
    scorers = _scorers(open_store(url_store), source, source.concepts, None, allow_weak_scorer)
    ray.init(address="local", include_dashboard=False, logging_level="ERROR")
    url = start_service(url_store, {c: s.info["key"] for c, s in scorers.items()}, host=host, port=port)
    console.print(f"serving POST {url}/score for {', '.join(scorers)}")
    while True:
        time.sleep(3600)
