"""The token budget per forward: hand-computed plans, and the same pooled vectors and D1 whatever the budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolbench.corpus.source import limit_passages, open_corpus
from poolbench.extractor.batching import (
    TokenCosts,
    default_max_batch_tokens,
    row_chunks,
    rows_per_forward,
    token_costs,
)
from poolbench.extractor.capture import ExtractionStats
from poolbench.extractor.extract import extract_batches
from poolbench.extractor.loading import load_model
from poolbench.extractor.padded_batches import prepare_batches
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.parses import ParseIndex, load_nlp, parse_table
from poolbench.pooler.pooled_table import PooledTableView
from poolbench.pooler.registry import resolve_strategies
from poolbench.prober.concept_probe import probe_pooled_table


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
    gradient = TokenCosts(plain=mib, attention_per_key=0, gradient=9 * mib)
    assert rows_per_forward(gradient, 1000, 30) == 3  # 1000 MiB // (10 MiB * 30)
    assert rows_per_forward(gradient, 100, 30) == 1  # the 512 MiB floor: 512 // 300
    small = TokenCosts(plain=1000, attention_per_key=0, gradient=9000)
    assert rows_per_forward(small, 1000, 30) == 33  # the floor lets S2 take every row the token budget allows
    with pytest.raises(ValueError):
        rows_per_forward(plain, 0, 8)


def test_default_budget_is_a_quarter_of_free_memory_capped_at_todays_largest_batch():
    assert default_max_batch_tokens(4 * 10**9, 100_000) == 8192  # 10,000 would fit
    assert default_max_batch_tokens(10**8, 100_000) == 250
    assert default_max_batch_tokens(0, 100_000) == 1


def test_token_costs_by_hand():
    costs = token_costs(hidden_size=8, intermediate_size=16, n_heads=2, vocab_size=10, n_layers=4, layers=[1, 3],
                        itemsize=4, out_itemsize=2, needs={"attention", "gradient"})
    assert costs.plain == 2 * 2 * 8 * 2 + 4 * (8 * 8 + 4 * 16)  # captured (kept twice) + one block = 64 + 512
    assert costs.attention_per_key == 4 * 2 * 4
    assert costs.gradient == 3 * 4 * (12 * 8 + 5 * 16) + 4 * 10 * 4  # layers 1..3 keep a graph; the logits
    assert token_costs(hidden_size=8, intermediate_size=16, n_heads=2, vocab_size=10, n_layers=4, layers=[1, 3],
                       itemsize=4, out_itemsize=2).gradient == 0


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path):
    return load_model(str(tiny_llama_dir), device="cpu")


@pytest.mark.numerics  # bit for bit across row counts: no kernel contract, so checked on each kernel set
def test_chunks_of_a_batch_hold_exactly_what_the_whole_batch_holds(tiny):
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
    np.testing.assert_array_equal(np.concatenate([c.hidden for c in chunks], axis=1), whole[0].hidden)
    for name, value in whole[0].extras.items():
        np.testing.assert_array_equal(np.concatenate([c.extras[name] for c in chunks], axis=1), value)


def test_pooled_table_and_d1_are_the_same_with_and_without_a_small_budget(tiny):
    concept = "hedging"
    passages = limit_passages(open_corpus("embedded", "tiny", [concept]).passages(concept), 12)
    parses = ParseIndex.from_table(parse_table(load_nlp(), [p.text for p in passages], [p.id for p in passages]))
    specs = resolve_strategies(None)
    assert len(specs) == 19

    def pooled(budget: int | None):
        return pool_concept_tables(tiny, passages, [0, 1], specs, batch_size=16, parses=parses,
                                   max_batch_tokens=budget)

    big_tables, small_tables = pooled(None), pooled(64)
    big, small = big_tables.pooled, small_tables.pooled
    lengths = [b.input_ids.shape for b in prepare_batches(tiny.tokenizer, passages, batch_size=16)]
    assert any(rows * length > 64 for rows, length in lengths)  # the small budget really cuts batches
    key = ["layer", "strategy", "passage_id"]
    assert big.num_rows == small.num_rows
    assert big.sort_by([(k, "ascending") for k in key]).equals(small.sort_by([(k, "ascending") for k in key]))
    big_view, small_view = PooledTableView(big), PooledTableView(small)
    assert big_view.cells == small_view.cells
    for layer, strategy in big_view.cells:  # what every reader sees: each cell's rows, in the same order
        a, b = big_view.matrix(layer, strategy), small_view.matrix(layer, strategy)
        assert a.passage_ids.tolist() == b.passage_ids.tolist()
        np.testing.assert_array_equal(a.X, b.X)
        np.testing.assert_array_equal(a.fallback, b.fallback)
    d1 = {"n_folds": 2, "seed": 0, "n_bootstrap": 20, "reliability": False}
    assert (probe_pooled_table(big, concept, heads=big_tables.heads, **d1)
            == probe_pooled_table(small, concept, heads=small_tables.heads, **d1))


def test_run_config_takes_a_positive_budget_or_none():
    from pydantic import ValidationError

    from poolbench.config import RunConfig

    assert RunConfig().max_batch_tokens is None
    assert RunConfig(max_batch_tokens=512).max_batch_tokens == 512
    with pytest.raises(ValidationError):
        RunConfig(max_batch_tokens=0)
