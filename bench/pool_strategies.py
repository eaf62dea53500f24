"""Pooling cost of every registered strategy (card + variants) with parses cached, and spaCy parse throughput.

Prints a table and writes bench/results/pool_strategies.json, all measured in one run on one model:
- plain forward time of the batches (no hooks, full depth): the baseline;
- extraction with every need (attention inflow at the probed layers, LM-likelihood gradients): its time over
  the forward, reported, not targeted (S2 is a forward plus a backward by definition);
- pooling: parse alignment + concept flags + pool_tokens of all strategies + S3 head vectors, per batch, with the
  concept's parses already cached (target <= 25% of the forward);
- spaCy parse throughput of nlp.pipe over the same passages (passages/s), and the cached-parse load time.
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
from poolbench.extractor.forward_baselines import forward_only
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import prepare_batches, tokenize_passages
from poolbench.pooler.chunk_extras import concept_text
from poolbench.pooler.concept_pooling import strategy_needs
from poolbench.pooler.iti import head_vectors
from poolbench.pooler.parses import ParseIndex, batch_parse_extras, cached_parse_table, ids_digest, load_nlp
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.reference_tokens import token_root_extra
from poolbench.pooler.registry import list_strategies
from poolbench.store.local import LocalStore

TARGETS = {"pool_share_of_forward": 0.25}


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    corpus = open_corpus("embedded", args.corpus_size)
    concept = args.concept or corpus.concepts[0]
    passages = corpus.passages(concept)
    specs = list_strategies(include_reference=True)
    needs = strategy_needs(specs)
    layers = list(range(loaded.n_layers))
    batches = prepare_batches(loaded.tokenizer, passages, batch_size=args.batch_size,
                              max_length=args.max_length)
    nlp = load_nlp()

    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(tmp)
        texts, ids = [p.text for p in passages], [p.id for p in passages]
        start = time.perf_counter()
        table, _ = cached_parse_table(store, texts, ids, corpus_hash="bench", passages_digest=ids_digest(ids),
                                      nlp=nlp)
        parse_s = time.perf_counter() - start
        start = time.perf_counter()
        table, cached = cached_parse_table(store, texts, ids, corpus_hash="bench",
                                           passages_digest=ids_digest(ids), nlp=nlp)
        parses = ParseIndex.from_table(table)
        cached_load_s = time.perf_counter() - start
        assert cached

    tokens = tokenize_passages(loaded.tokenizer, texts, ids, args.max_length)
    context = concept_text(concept, passages, tokens, range(len(passages)), needs, parses).context
    assert context is not None
    forward_only(loaded.model, batches[:2])  # warm-up
    forward_s, extract_s, pool_s = [], [], []
    for _ in range(args.repeats):
        forward_s.append(forward_only(loaded.model, batches).forward_seconds)
        start = time.perf_counter()
        acts = list(extract_batches(loaded.model, loaded.decoder_layers, batches, layers, needs=needs))
        extract_s.append(time.perf_counter() - start)
        pooling = 0.0
        for batch in acts:
            t0 = time.perf_counter()
            batch.extras.update(batch_parse_extras(parses, batch.passage_ids, batch.texts, batch.offsets,
                                                   batch.attention_mask, context.word_flags))
            batch.extras["unigram_probability"] = context.unigram_probability(batch.input_ids)
            if "tokens" in needs:  # the reference variants' word-initial token rule reads the token strings
                batch.extras["token_root"] = token_root_extra(loaded.tokenizer, batch.input_ids,
                                                              batch.attention_mask)
            pool_tokens(batch, specs)
            for spec in specs:
                if spec.supervision == "labels":
                    head_vectors(batch)
            pooling += time.perf_counter() - t0
        pool_s.append(pooling)
    tokens = sum(int(b.attention_mask.sum()) for b in batches)
    best_fwd, best_extract, best_pool = min(forward_s), min(extract_s), min(pool_s)
    header = run_header("pool_strategies", args, loaded.device)
    return {
        **header,
        "config": {**header["options"],
                   "concept": concept, "n_passages": len(passages), "n_batches": len(batches), "layers": layers,
                   "strategies": [s.id for s in specs], "needs": sorted(needs),
                   "spacy": nlp.meta.get("name"), "spacy_version": nlp.meta.get("version")},
        "tokens": tokens,
        "forward_seconds": best_fwd,
        "extract_all_needs_seconds": best_extract,
        "extract_over_forward": best_extract / best_fwd,
        "pool_seconds": best_pool,
        "pool_share_of_forward": best_pool / best_fwd,
        "parse_seconds": parse_s,
        "parse_passages_per_s": len(passages) / parse_s,
        "cached_parse_load_seconds": cached_load_s,
        "targets": TARGETS,
        "repeats": {"forward_s": forward_s, "extract_s": extract_s, "pool_s": pool_s},
    }


def report(result: dict, out: Path) -> None:
    cfg = result["config"]
    table = Table(title=f"all {len(cfg['strategies'])} strategies on {cfg['model']} ({cfg['n_passages']} "
                        f"passages, {result['tokens']} tokens, {len(cfg['layers'])} layers)")
    for column in ("measure", "value", "target", "met"):
        table.add_column(column)
    table.add_row("plain forward", f"{result['forward_seconds']:.3f} s", "", "")
    table.add_row("extract with attention + gradient", f"{result['extract_all_needs_seconds']:.3f} s "
                  f"({result['extract_over_forward']:.2f}x forward)", "", "")
    met = result["pool_share_of_forward"] <= TARGETS["pool_share_of_forward"]
    table.add_row("pooling (parses cached) / forward", f"{result['pool_share_of_forward']:.3f}",
                  f"<= {TARGETS['pool_share_of_forward']}", "yes" if met else "NO")
    table.add_row("spaCy parse throughput", f"{result['parse_passages_per_s']:.1f} passages/s", "", "")
    table.add_row("cached parse load", f"{result['cached_parse_load_seconds']:.3f} s", "", "")
    Console().print(table)
    write_result(result, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--concept", default=None, help="embedded concept (default: the first)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "pool_strategies.json")
    args = parser.parse_args()
    report(measure(args), args.out)


if __name__ == "__main__":
    main()
