"""The token budget per forward: hand-computed plans, and the same pooled vectors and D1 whatever the budget, up to
the forward's round-off (docs/reproducibility.md: another chunking is another computation, not the same bits)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from pooled_bounds import assert_same_tables
from tolerances import assert_float32_close

from poolbench.corpus.source import limit_passages, open_corpus
from poolbench.extractor.batching import (
    CPU_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_TOKENS,
    MEMORY_FRACTION,
    TokenCosts,
    budget_cap,
    default_max_batch_tokens,
    free_memory_bytes,
    gradient_rows_per_forward,
    plan_batches,
    row_chunks,
    rows_per_forward,
    token_costs,
)
from poolbench.extractor.capture import model_token_costs, resolve_max_batch_tokens
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import prepare_batches, tokenize_passages
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.parses import ParseIndex, load_nlp, parse_table
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import resolve_strategies
from poolbench.prober.concept_probe import probe_pooled_table
from poolbench.prober.d1 import evaluate_d1


def test_row_chunks_cover_every_row_once_in_order():
    assert row_chunks(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert row_chunks(3, 8) == [slice(0, 3)]
    assert row_chunks(0, 4) == []
    with pytest.raises(ValueError):
        row_chunks(3, 0)


def test_rows_per_forward_by_hand():
    plain = TokenCosts(plain=100, attention_per_key=0, gradient=0)
    assert rows_per_forward(plain, 1000, 30) == 33  # 1000 // 30 tokens' rows
    assert rows_per_forward(plain, 10, 64) == 1  # a row longer than the budget still runs, alone
    mib = 2**20
    attention = TokenCosts(plain=mib, attention_per_key=mib // 50, gradient=0)
    assert rows_per_forward(attention, 1000, 50) == 10  # 1000 MiB // ((1 + 50/50) MiB * 50)
    gradient = TokenCosts(plain=mib, attention_per_key=0, gradient=9 * mib, head_chunk=100 * mib)
    assert rows_per_forward(gradient, 1000, 30) == 33  # S2 never cuts the chunk the other strategies pool
    # S2's own rows: 0.8 of 2000 MiB free less the head's 100 MiB and the chunk's 33 * 30 MiB plain bytes,
    # over (1 + 9) MiB * 30 a row: (1600 - 100 - 990) // 300 = 1; with 4000 MiB free (3200 - 1090) // 300 = 7
    assert gradient_rows_per_forward(gradient, 1000, 30, 2000 * mib) == 1
    assert gradient_rows_per_forward(gradient, 1000, 30, 4000 * mib) == 7
    assert gradient_rows_per_forward(gradient, 1000, 30, 10**6 * mib) == 33  # never more than the chunk
    assert gradient_rows_per_forward(gradient, 1000, 30, 0) == 1
    with pytest.raises(ValueError):
        rows_per_forward(plain, 0, 8)


def test_default_budget_is_a_quarter_of_free_memory_capped_at_todays_largest_batch():
    assert default_max_batch_tokens(4 * 10**9, 100_000) == 8192  # 10,000 would fit
    assert default_max_batch_tokens(10**8, 100_000) == 250
    assert default_max_batch_tokens(0, 100_000) == 1


def test_a_cpu_forward_is_cache_sized_and_an_accelerator_forward_memory_sized():
    """Unless a run names a budget, a CPU forward holds at most CPU_MAX_BATCH_TOKENS padded tokens (faster there:
    bench/README.md, "Rows per forward on a CPU"), an accelerator's the largest batch its free memory allows."""
    assert budget_cap("cpu") == CPU_MAX_BATCH_TOKENS == 1024
    assert budget_cap("cuda") == budget_cap("cuda:1") == DEFAULT_MAX_BATCH_TOKENS == 8192
    assert default_max_batch_tokens(4 * 10**9, 100_000, cap=budget_cap("cpu")) == 1024
    assert default_max_batch_tokens(10**8, 100_000, cap=budget_cap("cpu")) == 250  # memory still bounds it


def test_token_costs_by_hand():
    costs = token_costs(hidden_size=8, intermediate_size=16, n_heads=2, vocab_size=10, n_layers=4, layers=[1, 3],
                        itemsize=4, out_itemsize=2, needs={"attention", "gradient"})
    assert costs.plain == 2 * 2 * 8 * 2 + 4 * (8 * 8 + 4 * 16)  # captured (kept twice) + one block = 64 + 512
    assert costs.attention_per_key == 0  # S1/S3's inflow is recomputed in query chunks: no length^2 term
    # per token: float32 accumulators (4 per head) and the float32 key copy (KV heads x head dim, here 2 x 4), + 4
    assert costs.attention_per_token == 4 * (4 * 2 + 2 * 4) + 4
    assert costs.attention_reserve == 256 * 2**20  # one query chunk's temporaries, once per forward
    # layers 1..3 keep a graph: 3 blocks of 4*(3*16 + 3*8 + 2*8) + 4*2*8 (no KV width given: the hidden size)
    assert costs.gradient == 3 * (4 * (3 * 16 + 3 * 8 + 2 * 8) + 4 * 2 * 8)
    assert costs.head_chunk == (2**30 // (10 * 16)) * 10 * 16  # one chunk of the LM head's logits work
    assert costs.gradient_per_key == 0  # sdpa keeps no probabilities; eager would: 3 blocks * 2 heads * 4 B
    assert token_costs(hidden_size=8, intermediate_size=16, n_heads=2, vocab_size=10, n_layers=4, layers=[1, 3],
                       itemsize=4, out_itemsize=2, needs={"gradient"}, eager_attention=True).gradient_per_key == 24
    assert token_costs(hidden_size=8, intermediate_size=16, n_heads=2, vocab_size=10, n_layers=4, layers=[1, 3],
                       itemsize=4, out_itemsize=2).gradient == 0


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir), device="cpu")


# Roundings along the tiny Llama (2 layers: 32 hidden, 64 MLP, up to 64 positions each) and, for the gradient
# extras, back again through them and the 320-token head (tests/tolerances.py).
FORWARD_TERMS = 2 * (32 + 64 + 64)
GRADIENT_TERMS = 2 * FORWARD_TERMS + 320


def assert_extras_close(chunked: dict[str, np.ndarray], whole: dict[str, np.ndarray], hidden: np.ndarray) -> None:
    """Each extra within the round-off of the chain that made it: attention shares and head outputs of the forward
    relative to their largest value (sums of non-negative weights or weighted means), gradient norms relative to the
    largest, and |g·h| relative to ‖g‖·‖h‖ per token (the dot product may cancel to ~0, as test_batched_saliency
    explains)."""
    assert set(chunked) == set(whole)
    for name, value in whole.items():
        if name == "gradient_x_input":
            scale = whole["gradient_norm"] * np.linalg.norm(hidden, axis=-1)
            assert_float32_close(chunked[name], value, terms=GRADIENT_TERMS, scale=scale, err_msg=name)
        elif name.startswith("gradient"):
            assert_float32_close(chunked[name], value, terms=GRADIENT_TERMS, err_msg=name)
        else:
            assert_float32_close(chunked[name], value, terms=FORWARD_TERMS, err_msg=name)


@pytest.mark.numerics  # across row counts: no kernel contract keeps the bits, so bounded and run on each kernel set
def test_chunks_of_a_batch_hold_what_the_whole_batch_holds_up_to_round_off(tiny):
    """A batch cut into chunks of the same padded length: the same rows, ids and lengths exactly; each token's
    states and extras within the forward's round-off (a GEMM may block differently for another row count)."""
    texts = ["a short one", "the cat sat on the mat today", "seven words are in this line", "x y",
             "a longer passage with quite a few more words than the others here"]
    batches = prepare_batches(tiny.tokenizer, texts, batch_size=8)
    (batch,) = batches
    length = batch.input_ids.shape[1]
    needs = {"attention", "labels", "gradient"}
    whole = list(extract_batches(tiny.model, tiny.decoder_layers, batches, [0, 1], needs=needs,
                                 max_batch_tokens=10**6))
    stats = ExtractionStats()
    chunks = list(extract_batches(tiny.model, tiny.decoder_layers, batches, [0, 1], needs=needs,
                                  max_batch_tokens=2 * length, stats=stats))
    assert len(whole) == 1 and len(chunks) == stats.batches > 1
    assert [pid for c in chunks for pid in c.passage_ids] == whole[0].passage_ids
    assert all(c.hidden.shape[2] == length for c in chunks)  # same padded length: the same forward per row
    np.testing.assert_array_equal(np.concatenate([c.attention_mask for c in chunks]), whole[0].attention_mask)
    hidden = np.concatenate([c.hidden for c in chunks], axis=1)
    assert_float32_close(hidden, whole[0].hidden, terms=FORWARD_TERMS)
    assert_extras_close({name: np.concatenate([c.extras[name] for c in chunks], axis=1) for name in chunks[0].extras},
                        whole[0].extras, whole[0].hidden)


def test_a_chunk_mixed_with_another_rows_state_fails_the_bound(tiny):
    """Should-fail: the bound above is no blanket: one token's state taken from the next row is caught."""
    texts = ["a short one", "the cat sat on the mat today"]
    (batch,) = prepare_batches(tiny.tokenizer, texts, batch_size=8)
    (out,) = extract_batches(tiny.model, tiny.decoder_layers, [batch], [0, 1], max_batch_tokens=10**6)
    mixed = out.hidden.copy()
    mixed[:, 0, -1] = out.hidden[:, 1, -1]
    with pytest.raises(AssertionError, match="differ by more than"):
        assert_float32_close(mixed, out.hidden, terms=FORWARD_TERMS)


def near_tie_pairs(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> int:
    """Opposite-label pairs whose order differs between two score vectors of the same passages: the only way a
    rank statistic (an AUROC, its bootstrap interval) can differ between them."""
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    order_a = np.sign(a[pos][:, None] - a[neg][None, :])
    order_b = np.sign(b[pos][:, None] - b[neg][None, :])
    return int((order_a != order_b).sum())


@pytest.mark.numerics  # pooled across other chunkings: equal up to round-off, on each kernel set
def test_pooled_table_and_d1_are_the_same_with_and_without_a_small_budget(tiny):
    """The same rows, ids and fallbacks exactly, every vector within the forward's round-off (tests/pooled_bounds.py);
    D1 bit for bit in every cell whose probe scores order every opposite-label pair alike under both budgets
    (an AUROC is a function of that order), and any other cell differs only by such a near-tie."""
    concept = "hedging"
    passages = limit_passages(open_corpus("embedded", "tiny", [concept]).passages(concept), 12)
    parses = ParseIndex.from_table(parse_table(load_nlp(), [p.text for p in passages], [p.id for p in passages]))
    specs = resolve_strategies(None)
    assert len(specs) == 19

    def pooled(budget: int | None):
        return pool_concept_tables(tiny, passages, [0, 1], specs, batch_size=16, parses=parses,
                                   max_batch_tokens=budget)

    big_tables, small_tables = pooled(10**6), pooled(64)
    lengths = [b.input_ids.shape for b in prepare_batches(tiny.tokenizer, passages, batch_size=16)]
    assert any(rows * length > 64 for rows, length in lengths)  # the small budget really cuts batches
    for layer in (0, 1):
        assert_same_tables(big_tables.layers[layer], small_tables.layers[layer], f"layer {layer}")
    big_view, small_view = PooledTableView(big_tables.pooled), PooledTableView(small_tables.pooled)
    assert big_view.cells == small_view.cells
    d1 = {"n_folds": 2, "seed": 0, "n_bootstrap": 20, "reliability": False}
    big_d1 = probe_pooled_table(big_tables.pooled, concept, heads=big_tables.heads, **d1)
    small_d1 = probe_pooled_table(small_tables.pooled, concept, heads=small_tables.heads, **d1)
    assert [(r.layer, r.strategy, r.probe) for r in big_d1] == [(r.layer, r.strategy, r.probe) for r in small_d1]
    differing = {(a.layer, a.strategy) for a, b in zip(big_d1, small_d1, strict=True) if a != b}
    for layer, strategy in differing:
        a, b = big_view.matrix(layer, strategy), small_view.matrix(layer, strategy)
        train, test = a.split == "train", a.split == "test"
        flips = 0
        for probe in ("logistic", "diffmean"):
            ra, rb = (evaluate_d1(m.X[train], m.y[train], m.groups[train], m.X[test], m.y[test], m.groups[test],
                                  n_folds=2, seed=0, n_bootstrap=20).probes[probe] for m in (a, b))
            flips += near_tie_pairs(ra.oof_scores, rb.oof_scores, a.y[train])
            flips += near_tie_pairs(ra.test_scores, rb.test_scores, a.y[test])
        assert flips > 0, f"D1 of layer {layer} {strategy} differs with no pair of scores changing order"


def test_run_config_takes_a_positive_budget_or_none():
    from pydantic import ValidationError

    from poolbench.config import RunConfig

    assert RunConfig().max_batch_tokens is None
    assert RunConfig(max_batch_tokens=512).max_batch_tokens == 512
    with pytest.raises(ValidationError):
        RunConfig(max_batch_tokens=0)


def test_a_cpu_run_gets_the_cpu_budget_and_its_buckets_are_cut_at_it(tiny):
    """The default budget of a model on the CPU is the cache-sized one (memory here holds far more), and pooling
    cuts its length buckets at the budget, not only chunks of one padded length inside them: the padded tokens
    are exactly those of plan_batches(lengths, batch_size, budget), fewer than 16-row buckets chunked at the
    budget would pad (the behaviour before; a chunk keeps its bucket's length)."""
    plain = model_token_costs(tiny.model, [0, 1], frozenset()).plain
    assert resolve_max_batch_tokens(tiny.model, [0, 1], None) == min(
        CPU_MAX_BATCH_TOKENS, int(free_memory_bytes("cpu") * MEMORY_FRACTION) // plain) == CPU_MAX_BATCH_TOKENS
    concept = "hedging"
    full = limit_passages(open_corpus("embedded", "tiny", [concept]).passages(concept), 6)
    # the tiny corpus's passages all fill 256 tokens: cut each to its own number of words, so lengths differ
    passages = [dataclasses.replace(p, text=" ".join(p.text.split()[:8 + 5 * i])) for i, p in enumerate(full)]
    lengths = list(tokenize_passages(tiny.tokenizer, [p.text for p in passages], [p.id for p in passages],
                                     256).lengths)
    assert len(set(lengths)) > 12
    budget = 3 * max(lengths)
    stats = ExtractionStats()
    pool_concept_tables(tiny, passages, [0, 1], resolve_strategies(["A1", "P1"]), batch_size=16,
                        max_batch_tokens=budget, stats=stats)
    cut = plan_batches(lengths, 16, budget)
    assert stats.batches == len(cut) and stats.tokens == sum(lengths)
    assert stats.padded_tokens == sum(len(b) * lengths[b[0]] for b in cut)
    chunked = sum(lengths[b[0]] * len(b) for b in plan_batches(lengths, 16))  # 16-row buckets, any chunking
    assert stats.padded_tokens < chunked
