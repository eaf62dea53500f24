"""Extraction + pooling throughput on one model, all ratios measured in one run.

Prints a table and writes bench/results/extract_pool.json:
- raw forward tokens/s vs the whole extract+pool+write path (target ratio <= 1.2);
- all strategies' pooling time as a share of the forward (target <= 10%);
- speed-up of the batched contraction over a per-passage, per-strategy Python loop (target >= 5x).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from bench_io import add_model_options, run_header, write_result
from rich.console import Console
from rich.table import Table

from poolbench.corpus.source import open_corpus
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.forward_baselines import forward_only
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import prepare_batches
from poolbench.pooler.naive import pool_naive
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.pooler.registry import resolve_strategies
from poolbench.store.local import LocalStore

TARGETS = {"path_over_forward": 1.2, "pool_share_of_forward": 0.10, "speedup_over_naive": 5.0}


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    corpus = open_corpus("embedded", args.corpus_size)
    passages = [p for c in corpus.concepts[: args.concepts] for p in corpus.passages(c)]
    # The strategies that pool hidden states alone; those needing attention, gradients or parses are
    # measured by bench/pool_strategies.py with their extra extraction work.
    specs = [s for s in resolve_strategies(None) if not s.needs]
    layers = list(range(loaded.n_layers))
    batches = prepare_batches(loaded.tokenizer, passages, batch_size=args.batch_size, max_length=args.max_length)
    forward_only(loaded.model, batches[:2])  # warm-up: allocator, kernels, caches

    forward_s, path_s, pool_s = [], [], []
    for _ in range(args.repeats):
        fwd = forward_only(loaded.model, batches)
        forward_s.append(fwd.forward_seconds)

        stats, pooling = ExtractionStats(), 0.0
        start = time.perf_counter()
        builder = PooledTableBuilder(passages, loaded.hidden_size)
        for batch in extract_batches(loaded.model, loaded.decoder_layers, batches, layers, stats=stats):
            t0 = time.perf_counter()
            pooled = pool_tokens(batch, specs)
            pooling += time.perf_counter() - t0
            builder.add(pooled.vectors, pooled.layers, pooled.strategy_ids, pooled.passage_ids, pooled.fallback)
        with tempfile.TemporaryDirectory() as tmp:
            LocalStore(tmp).put_table("pooled/bench", builder.table())
        path_s.append(time.perf_counter() - start)
        pool_s.append(pooling)
    tokens = fwd.tokens

    naive_batches = batches[: args.naive_batches]
    acts = list(extract_batches(loaded.model, loaded.decoder_layers, naive_batches, layers))
    t0 = time.perf_counter()
    for batch in acts:
        pool_tokens(batch, specs)
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    for batch in acts:
        pool_naive(batch, specs)
    naive = time.perf_counter() - t0

    best_fwd, best_path, best_pool = min(forward_s), min(path_s), min(pool_s)
    header = run_header("extract_pool", args, loaded.device)
    return {
        **header,
        "config": {**header["options"],
                   "n_passages": len(passages), "n_batches": len(batches), "layers": layers,
                   "strategies": [s.id for s in specs], "hidden_size": loaded.hidden_size},
        "tokens": tokens,
        "forward_tokens_per_s": tokens / best_fwd,
        "path_tokens_per_s": tokens / best_path,
        "path_over_forward": best_path / best_fwd,
        "pool_seconds": best_pool,
        "pool_share_of_forward": best_pool / best_fwd,
        "naive_seconds": naive,
        "batched_seconds": fast,
        "speedup_over_naive": naive / fast,
        "targets": TARGETS,
        "repeats": {"forward_s": forward_s, "path_s": path_s, "pool_s": pool_s},
    }


def report(result: dict, out: Path) -> None:
    table = Table(title=f"extract + pool on {result['config']['model']} ({result['tokens']} tokens, "
                        f"{len(result['config']['layers'])} layers, {len(result['config']['strategies'])} strategies)")
    for column in ("measure", "value", "target", "met"):
        table.add_column(column)
    table.add_row("forward alone", f"{result['forward_tokens_per_s']:,.0f} tok/s", "", "")
    table.add_row("extract+pool+write", f"{result['path_tokens_per_s']:,.0f} tok/s", "", "")
    rows = [("path time / forward time", "path_over_forward", "<=", "{:.3f}"),
            ("pooling time / forward time", "pool_share_of_forward", "<=", "{:.3f}"),
            ("speed-up over naive loops", "speedup_over_naive", ">=", "{:.1f}x")]
    for label, key, op, fmt in rows:
        target = TARGETS[key]
        met = result[key] <= target if op == "<=" else result[key] >= target
        table.add_row(label, fmt.format(result[key]), f"{op} {target}", "yes" if met else "NO")
    Console().print(table)
    write_result(result, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--concepts", type=int, default=4, help="how many embedded concepts to run")
    parser.add_argument("--naive-batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "extract_pool.json")
    args = parser.parse_args()
    report(measure(args), args.out)


if __name__ == "__main__":
    main()
