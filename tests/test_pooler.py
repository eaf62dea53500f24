"""pool_tokens against hand-computed vectors on tiny batches and against pool_naive on random padded ones."""

from __future__ import annotations

import numpy as np
import pytest
from tolerances import assert_pooled_close as assert_pooled

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.naive import pool_naive
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.registry import get_strategy, resolve_strategies
from poolbench.pooler.sink import attention_sink_rows, uniform_causal_inflow
from poolbench.pooler.spec import StrategySpec, TokenContext
from poolbench.pooler.windows import window_spec

PAD = 99.0

pytestmark = pytest.mark.numerics


def make_batch(passages: list[list[list[float]]], length: int, left: list[bool]) -> ActivationBatch:
    """A one-layer batch from per-passage token rows; padding rows hold ±99 so any leak is obvious."""
    dim = len(passages[0][0])
    hidden = np.full((1, len(passages), length, dim), PAD, dtype=np.float32)
    mask = np.zeros((len(passages), length), dtype=bool)
    for b, tokens in enumerate(passages):
        start = length - len(tokens) if left[b] else 0
        hidden[0, b, start:start + len(tokens)] = tokens
        mask[b, start:start + len(tokens)] = True
        hidden[0, b, ~mask[b]] *= np.where(np.arange((~mask[b]).sum()) % 2, -1, 1)[:, None]
    return batch_from(hidden, mask)


def batch_from(hidden: np.ndarray, mask: np.ndarray) -> ActivationBatch:
    n_layers, batch, length, _ = hidden.shape
    return ActivationBatch(
        passage_ids=[f"p{b}" for b in range(batch)], texts=["text"] * batch, layers=tuple(range(n_layers)),
        hidden=hidden, attention_mask=mask, input_ids=np.zeros((batch, length), dtype=np.int64),
        offsets=np.zeros((batch, length, 2), dtype=np.int32), special_mask=np.zeros((batch, length), bool),
    )


# p0: 4 tokens, right padding; p1: 3 tokens, left padding. Rows chosen with integer L2 norms.
TINY = make_batch(
    [[[3, 4], [0, 2], [-6, 8], [5, 0]],
     [[0, -1], [4, 3], [-3, 0]]],
    length=5, left=[False, True],
)

EXPECTED = {
    "P1_last": [[5, 0], [-3, 0]],
    "P2_first": [[3, 4], [0, -1]],
    "A1_mean": [[0.5, 3.5], [1 / 3, 2 / 3]],
    "A2_max": [[5, 8], [4, 3]],
    "A3_min": [[-6, 0], [-3, -1]],
    # norms p0: 5, 2, 10, 5 (sum 22); p1: 1, 5, 3 (sum 9)
    "A4_norm_weighted": [[-20 / 22, 104 / 22], [11 / 9, 14 / 9]],
    # k = 8 exceeds both passages, so every window strategy is the plain mean
    "W1_first_k": [[0.5, 3.5], [1 / 3, 2 / 3]],
    "W2_last_k": [[0.5, 3.5], [1 / 3, 2 / 3]],
    "W3_middle_k": [[0.5, 3.5], [1 / 3, 2 / 3]],
    # 4 tokens -> 4 chunks of one; 3 tokens (fewer than 4 chunks) -> each its own chunk
    "W4_hierarchical": [[0.5, 3.5], [1 / 3, 2 / 3]],
}


@pytest.mark.parametrize("strategy_id", list(EXPECTED))
def test_each_builtin_strategy_matches_hand_computed_vectors(strategy_id: str) -> None:
    pooled = pool_tokens(TINY, [get_strategy(strategy_id)])
    assert pooled.vectors.shape == (1, 1, 2, 2)
    assert_pooled(pooled.vectors[0, 0], EXPECTED[strategy_id], TINY)
    assert not pooled.fallback.any()


def test_all_strategies_in_one_call_match_one_at_a_time() -> None:
    pooled = pool_tokens(TINY, resolve_strategies(list(EXPECTED)))
    assert pooled.strategy_ids == list(EXPECTED)
    assert pooled.vectors.dtype == np.float32
    for s, strategy_id in enumerate(pooled.strategy_ids):
        assert_pooled(pooled.vectors[0, s], EXPECTED[strategy_id], TINY, strategy_id)


@pytest.mark.parametrize(("code", "k", "expected"), [
    ("W1", 2, [[1.5, 3], [2, 1]]),
    ("W2", 2, [[-0.5, 4], [0.5, 1.5]]),
    # W3 k=2: 4 tokens (even) -> tokens 1,2 exactly centred; 3 tokens (odd) -> tokens 0,1 (one earlier)
    ("W3", 2, [[-3, 5], [2, 1]]),
    # W3 k=1: 4 tokens -> token 1 (one earlier than 1.5); 3 tokens -> token 1 (exact middle)
    ("W3", 1, [[0, 2], [4, 3]]),
    # W3 k=3: 4 tokens -> tokens 0..2; 3 tokens -> all
    ("W3", 3, [[-1, 14 / 3], [1 / 3, 2 / 3]]),
])
def test_window_sizes_by_hand(code: str, k: int, expected: list[list[float]]) -> None:
    pooled = pool_tokens(TINY, [window_spec(code, k=k)])
    assert_pooled(pooled.vectors[0, 0], expected, TINY)


def test_w3_middle_of_odd_and_even_lengths_with_odd_k() -> None:
    batch = make_batch([[[v] for v in range(7)], [[v] for v in range(10, 16)]], length=8, left=[True, False])
    pooled = pool_tokens(batch, [window_spec("W3", k=3)])
    # 7 tokens: start (7-3)//2 = 2 -> 2,3,4; 6 tokens: start (6-3)//2 = 1 -> 11,12,13
    assert_pooled(pooled.vectors[0, 0, :, 0], [3.0, 12.0], batch)


def test_w4_chunks_with_10_and_5_tokens() -> None:
    tokens = [[[v] for v in range(10)], [[10], [20], [30], [40], [50]]]
    batch = make_batch(tokens, length=10, left=[False, True])
    pooled = pool_tokens(batch, [get_strategy("W4"), window_spec("W4", n_chunks=2)])
    # 10 tokens in 4 chunks: [0,1,2] [3,4,5] [6,7] [8,9] -> means 1, 4, 6.5, 8.5 -> 5.0
    # 5 tokens in 4 chunks: [10,20] [30] [40] [50] -> means 15, 30, 40, 50 -> 33.75
    assert_pooled(pooled.vectors[0, 0, :, 0], [5.0, 33.75], batch)
    # 2 chunks: [0..4] [5..9] -> 2, 7 -> 4.5; [10,20,30] [40,50] -> 20, 45 -> 32.5
    assert_pooled(pooled.vectors[0, 1, :, 0], [4.5, 32.5], batch)


def test_p1_p2_with_left_padding_pick_first_and_last_real_tokens() -> None:
    batch = make_batch([[[1], [2]], [[7], [8], [9], [10]]], length=6, left=[True, True])
    pooled = pool_tokens(batch, resolve_strategies(["P1", "P2"]))
    np.testing.assert_allclose(pooled.vectors[0, :, :, 0], [[2, 10], [1, 7]])


def test_left_and_right_padding_give_identical_vectors() -> None:
    rng = np.random.default_rng(3)
    tokens = [rng.standard_normal((n, 4)).tolist() for n in (1, 5, 9)]
    left = make_batch(tokens, length=12, left=[True, True, True])
    right = make_batch(tokens, length=12, left=[False, False, False])
    specs = resolve_strategies(list(EXPECTED))
    assert_pooled(pool_tokens(left, specs).vectors, pool_tokens(right, specs).vectors, left)


def random_batch(seed: int, n_layers: int = 3, batch: int = 7, length: int = 20, dim: int = 6,
                 ) -> ActivationBatch:
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n_layers, batch, length, dim)).astype(np.float32) * 3
    mask = np.zeros((batch, length), dtype=bool)
    lengths = rng.integers(1, length + 1, batch)
    lengths[:3] = (1, length, 2)
    for b, n in enumerate(lengths):
        if rng.random() < 0.5:
            mask[b, length - n:] = True
        else:
            mask[b, :n] = True
    return batch_from(hidden, mask)


@pytest.mark.parametrize("seed", range(5))
def test_pool_tokens_equals_pool_naive_on_random_padded_batches(seed: int) -> None:
    specs = [*resolve_strategies(list(EXPECTED)), window_spec("W1", k=3), window_spec("W2", k=5),
             window_spec("W3", k=4), window_spec("W3", k=5), window_spec("W4", n_chunks=3)]
    batch = random_batch(seed)
    fast, naive = pool_tokens(batch, specs), pool_naive(batch, specs)
    assert fast.strategy_ids == naive.strategy_ids
    assert fast.layers == naive.layers and fast.passage_ids == naive.passage_ids
    assert_pooled(fast.vectors, naive.vectors, batch)
    np.testing.assert_array_equal(fast.fallback, naive.fallback)


def test_norm_weights_are_per_layer() -> None:
    hidden = np.array([[[[3, 4], [0, 1]]], [[[3, 4], [0, 10]]]], dtype=np.float32)  # L=2, B=1, T=2
    pooled = pool_tokens(batch_from(hidden, np.ones((1, 2), bool)), [get_strategy("A4")])
    # layer 0: norms 5, 1 -> (5*[3,4] + [0,1]) / 6; layer 1: norms 5, 10 -> (5*[3,4] + 10*[0,10]) / 15
    assert_pooled(pooled.vectors[:, 0, 0], [[15 / 6, 21 / 6], [1.0, 8.0]], batch_from(hidden, np.ones((1, 2), bool)))


def _custom(strategy_id: str, weights_fn) -> StrategySpec:
    return StrategySpec(id=strategy_id, code=strategy_id.split("_")[0], family="other", kind="weights",
                        weights_fn=weights_fn, description="A test strategy used to exercise the pooler.")


def test_spec_selecting_no_token_falls_back_to_mean_and_is_flagged() -> None:
    nothing = _custom("X1_nothing", lambda ctx: np.zeros(ctx.attention_mask.shape))
    # selects only special tokens: p0 has one at its first real position, p1 none
    special_only = _custom("X2_special", lambda ctx: ctx.special_mask)
    # layer-dependent: selects nothing at layer 0 only
    late = _custom("X3_late", lambda ctx: np.stack([np.zeros_like(ctx.attention_mask), ctx.attention_mask]))
    batch = batch_from(np.concatenate([TINY.hidden, 2 * TINY.hidden]), TINY.attention_mask)
    batch.special_mask[0, 0] = True
    specs = [nothing, get_strategy("A2"), special_only, late]
    pooled = pool_tokens(batch, specs)
    mean = np.array([[0.5, 3.5], [1 / 3, 2 / 3]])
    expected_fallback = [[True, True], [False, False], [False, True], [True, True]]
    np.testing.assert_array_equal(pooled.fallback, expected_fallback)
    assert_pooled(pooled.vectors[:, 0], [mean, 2 * mean], batch)
    assert_pooled(pooled.vectors[:, 2], [[[3, 4], mean[1]], [[6, 8], 2 * mean[1]]], batch)
    assert_pooled(pooled.vectors[:, 3], [mean, 2 * mean], batch)
    naive = pool_naive(batch, specs)
    assert_pooled(pooled.vectors, naive.vectors, batch)
    np.testing.assert_array_equal(pooled.fallback, naive.fallback)


def test_weights_on_padding_are_ignored() -> None:
    everywhere = _custom("X4_everywhere", lambda ctx: np.ones(ctx.attention_mask.shape))
    assert_pooled(pool_tokens(TINY, [everywhere]).vectors[0, 0], EXPECTED["A1_mean"], TINY)


def test_token_context_rank_ignores_padding_side() -> None:
    ctx = TokenContext.from_batch(TINY)
    np.testing.assert_array_equal(ctx.rank, [[0, 1, 2, 3, -1], [-1, -1, 0, 1, 2]])
    np.testing.assert_array_equal(ctx.lengths, [4, 3])


@pytest.mark.parametrize(("weights_fn", "message"), [
    (lambda ctx: np.ones(3), "weights have shape"),
    (lambda ctx: -np.ones(ctx.attention_mask.shape), "non-negative"),
    (lambda ctx: np.full(ctx.attention_mask.shape, np.nan), "finite"),
    (lambda ctx: 1 / 0, "weights_fn failed: ZeroDivisionError"),
])
def test_bad_weights_raise_one_line_strategy_error(weights_fn, message: str) -> None:
    with pytest.raises(StrategyError, match=message) as info:
        pool_tokens(TINY, [_custom("X5_bad", weights_fn)])
    assert "X5_bad" in str(info.value) and "\n" not in str(info.value)


def test_repeated_strategy_and_empty_passage_are_errors() -> None:
    with pytest.raises(StrategyError, match="given twice: A1_mean"):
        pool_tokens(TINY, [get_strategy("A1"), get_strategy("A1_mean")])
    empty = batch_from(TINY.hidden, np.array([[True] * 5, [False] * 5]))
    with pytest.raises(StrategyError, match="passage 'p1' has no real tokens"):
        pool_tokens(empty, [get_strategy("A1")])


def test_no_strategies_gives_an_empty_strategy_axis() -> None:
    pooled = pool_tokens(TINY, [])
    assert pooled.vectors.shape == (1, 0, 2, 2) and pooled.fallback.shape == (0, 2)


def test_pooled_vectors_do_not_alias_the_hidden_states() -> None:
    batch = random_batch(0)
    before = batch.hidden.copy()
    pooled = pool_tokens(batch, resolve_strategies(list(EXPECTED)))
    pooled.vectors[...] = 0
    np.testing.assert_array_equal(batch.hidden, before)


def test_masks_with_holes_still_match_pool_naive() -> None:
    """ActivationBatch promises one run of real tokens, but a mask with holes must not give wrong vectors."""
    batch = random_batch(11)
    batch.attention_mask[:, 3] = False
    batch.attention_mask[:, 0] = True
    specs = resolve_strategies(list(EXPECTED))
    fast, naive = pool_tokens(batch, specs), pool_naive(batch, specs)
    assert_pooled(fast.vectors, naive.vectors, batch)


# p0's first token [30, 40] has norm 50 against others' norms 2, 10, 5 (median 5): ratio 10, a sink.
# p1's first token has norm 1 against 5 and 3: no sink.
SINK_BATCH = make_batch(
    [[[30, 40], [0, 2], [-6, 8], [5, 0]],
     [[0, -1], [4, 3], [-3, 0]]],
    length=5, left=[False, True],
)
SINK_EXPECTED = {  # mode -> strategy -> [p0, p1]
    "auto": {"A1_mean": [[-1 / 3, 10 / 3], [1 / 3, 2 / 3]], "A2_max": [[5, 8], [4, 3]],
             "A3_min": [[-6, 0], [-3, -1]],
             # p0 without its sink: norms 2, 10, 5 (sum 17); p1 keeps all: norms 1, 5, 3 (sum 9)
             "A4_norm_weighted": [[-35 / 17, 84 / 17], [11 / 9, 14 / 9]]},
    "keep": {"A1_mean": [[29 / 4, 50 / 4], [1 / 3, 2 / 3]], "A2_max": [[30, 40], [4, 3]],
             "A3_min": [[-6, 0], [-3, -1]],
             # norms 50, 2, 10, 5 (sum 67): (50*[30,40] + 2*[0,2] + 10*[-6,8] + 5*[5,0]) / 67
             "A4_norm_weighted": [[1465 / 67, 2084 / 67], [11 / 9, 14 / 9]]},
    "skip": {"A1_mean": [[-1 / 3, 10 / 3], [1 / 2, 3 / 2]], "A2_max": [[5, 8], [4, 3]],
             "A3_min": [[-6, 0], [-3, 0]],
             # p1 without its first token: norms 5, 3 (sum 8): (5*[4,3] + 3*[-3,0]) / 8
             "A4_norm_weighted": [[-35 / 17, 84 / 17], [11 / 8, 15 / 8]]},
}


@pytest.mark.parametrize("mode", list(SINK_EXPECTED))
@pytest.mark.parametrize("strategy_id", list(SINK_EXPECTED["auto"]))
def test_uniform_aggregation_with_and_without_the_sink_by_hand(mode: str, strategy_id: str) -> None:
    spec = get_strategy(strategy_id).with_sink_mode(mode)
    pooled = pool_tokens(SINK_BATCH, [spec])
    assert_pooled(pooled.vectors[0, 0], SINK_EXPECTED[mode][strategy_id], SINK_BATCH)
    assert_pooled(pool_naive(SINK_BATCH, [spec]).vectors, pooled.vectors, SINK_BATCH)
    assert not pooled.fallback.any()


def test_default_of_a1_to_a4_is_auto_and_the_fingerprint_says_so() -> None:
    for strategy_id in SINK_EXPECTED["auto"]:
        spec = get_strategy(strategy_id)
        assert spec.sink_mode == "auto" and spec.fingerprint()["params"] == {"sink": "auto"}
        assert_pooled(pool_tokens(SINK_BATCH, [spec]).vectors[0, 0], SINK_EXPECTED["auto"][strategy_id], SINK_BATCH)
    assert get_strategy("P2_first").sink_mode == "keep" and get_strategy("W1").fingerprint()["params"] == {"k": 8}
    with pytest.raises(StrategyError, match="param 'sink' must be one of auto, skip, keep, got 'drop'"):
        get_strategy("A1").with_sink_mode("drop")


def test_sink_is_decided_per_layer_and_s1_drops_it_too() -> None:
    # layer 0: SINK_BATCH; layer 1: p0's first token shrunk to [3, 4] (norm 5 = the others' median: no sink)
    layer1 = SINK_BATCH.hidden[0].copy()
    layer1[0, 0] = [3, 4]
    batch = batch_from(np.stack([SINK_BATCH.hidden[0], layer1]), SINK_BATCH.attention_mask)
    inflow = np.zeros((2, 2, 5), dtype=np.float32)
    inflow[:, 0, :4] = [0.7, 0.1, 0.1, 0.1]  # p0 (right padded): most attention on the first token
    inflow[:, 1, 2:] = [0.7, 0.1, 0.2]  # p1 (left padded)
    batch.extras["attention_inflow"] = inflow
    specs = [get_strategy("A1"), get_strategy("S1_attention")]
    pooled = pool_tokens(batch, specs)
    kept = pool_tokens(batch, [get_strategy("S1_attention").with_sink_mode("keep")])
    assert_pooled(pooled.vectors[:, 0, 0], [[-1 / 3, 10 / 3], [2 / 4, 14 / 4]], batch)
    # S1 auto at layer 0: p0's sink left out, the rest weighted equally; layer 1 keeps it (0.7 on [3, 4])
    assert_pooled(pooled.vectors[:, 1, 0], [[-1 / 3, 10 / 3], [2.0, 3.8]], batch)
    assert_pooled(kept.vectors[0, 0, 0], [20.9, 29.0], batch)
    # p1 has no sink at either layer: 0.7*[0,-1] + 0.1*[4,3] + 0.2*[-3,0]
    assert_pooled(pooled.vectors[:, 1, 1], [[-0.2, -0.4]] * 2, batch)
    assert_pooled(pool_naive(batch, specs).vectors, pooled.vectors, batch)


def test_auto_needs_two_other_tokens_and_skip_keeps_a_lone_token() -> None:
    # p0: two tokens, the first 50x the second: too few others to call it a sink; p1: one token
    batch = make_batch([[[30, 40], [0, 1]], [[7, 7]]], length=2, left=[False, False])
    auto = pool_tokens(batch, [get_strategy("A1")])
    assert_pooled(auto.vectors[0, 0], [[15, 20.5], [7, 7]], batch)
    skip = pool_tokens(batch, [get_strategy("A1").with_sink_mode("skip")])
    assert_pooled(skip.vectors[0, 0], [[0, 1], [7, 7]], batch)
    assert not skip.fallback.any()


@pytest.mark.parametrize("seed", range(3))
def test_auto_pools_bit_for_bit_as_keep_where_there_is_no_sink(seed: int) -> None:
    batch = random_batch(seed)
    ids = [*SINK_EXPECTED["auto"], "S1_attention"]
    batch.extras["attention_inflow"] = np.random.default_rng(seed).random(
        (batch.hidden.shape[0], *batch.attention_mask.shape)).astype(np.float32)
    auto = [get_strategy(s) for s in ids]
    keep = [s.with_sink_mode("keep") for s in auto]
    np.testing.assert_array_equal(pool_tokens(batch, auto).vectors, pool_tokens(batch, keep).vectors)


def test_uniform_causal_inflow_by_hand_on_either_padding_side() -> None:
    mask = np.array([[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=bool)
    h4 = 1 + 1 / 2 + 1 / 3 + 1 / 4
    expected = [h4 / 4, (h4 - 1) / 4, (h4 - 1.5) / 4, (h4 - 1.5 - 1 / 3) / 4]  # 0.521, 0.271, 0.146, 0.0625
    out = uniform_causal_inflow(mask, "all")
    assert out.dtype == np.float64  # sums of <= 4 fractions <= 1 in float64: round-off ~1e-15, far inside 1e-12
    np.testing.assert_allclose(out[0], [*expected, 0], atol=1e-12)
    np.testing.assert_allclose(out[1], [0, *expected], atol=1e-12)
    np.testing.assert_allclose(out.sum(axis=1), [1, 1], atol=1e-12)  # a distribution, as S1's inflow is
    np.testing.assert_allclose(uniform_causal_inflow(mask, "last")[1], [0, 0.25, 0.25, 0.25, 0.25])


@pytest.mark.parametrize(("extra", "dropped"), [(0.0, False), (0.1, False), (0.2, True), (0.58, True)])
def test_s1_drops_an_attention_sink_whose_norm_has_collapsed(extra: float, dropped: bool) -> None:
    # 100 tokens of equal norm (no norm sink); the heads attend uniformly-causally except `extra` of every
    # query's mass moved to the first token. Relative to its uniform share H_100/100 = 0.052: 20% extra is
    # 5.8x the others' ratio (a sink, as SmolLM2 layer 10), 10% extra 3.1x (kept), none exactly 1x.
    n = 100
    mask = np.ones((1, n), dtype=bool)
    hidden = np.zeros((1, 1, n, 2), dtype=np.float32)
    hidden[0, 0, :, 0] = 1.0
    hidden[0, 0, 0] = [0.0, 1.0]  # the first token points elsewhere, with the same norm
    batch = batch_from(hidden, mask)
    inflow = (1 - extra) * uniform_causal_inflow(mask, "all")
    inflow[0, 0] += extra
    batch.extras["attention_inflow"] = inflow[None].astype(np.float32)
    assert bool(attention_sink_rows(inflow, mask, "all")[0, 0]) is dropped
    pooled = pool_tokens(batch, [get_strategy("S1_attention")])
    weight_first = 0.0 if dropped else inflow[0, 0] / inflow.sum()
    assert_pooled(pooled.vectors[0, 0, 0], [1 - weight_first, weight_first], batch)
    assert not pool_tokens(batch, [get_strategy("A1")]).fallback.any()
    assert_pooled(pool_tokens(batch, [get_strategy("A1")]).vectors[0, 0, 0], [0.99, 0.01], batch)
    assert_pooled(pool_naive(batch, [get_strategy("S1_attention")]).vectors, pooled.vectors, batch)
