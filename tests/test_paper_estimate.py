"""The paper estimate's arithmetic, on a tiny shape and on Llama-3.1-8B, against numbers worked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import paper_estimate as pe  # bench/ holds scripts, not a package

# d = 8, 2 heads of 4 over 1 KV head (kv = 4), d_ff = 16, V = 32, 2 layers, untied head
TINY = pe.ModelShape("tiny", n_layers=2, hidden_size=8, n_heads=2, n_kv_heads=1, intermediate_size=16,
                     vocab_size=32, tied_embeddings=False)


def test_parameter_count_by_hand() -> None:
    # block: q, o 8*8 = 64 each; k, v 8*4 = 32 each; MLP 3*8*16 = 384 -> 576, + 2 norms of 8 -> 592
    assert pe.layer_matmul_params(TINY) == 576
    # embedding 32*8 = 256, 2 blocks 1184, final norm 8, untied head 256
    assert pe.parameter_count(TINY) == 1704


def test_parameter_counts_of_the_real_shapes() -> None:
    assert pe.parameter_count(pe.LLAMA_31_8B) == 8_030_261_248  # the published 8.03 B
    assert pe.parameter_count(pe.SMOLLM2_135M) == 134_515_008  # 134.5 M, head tied to the embedding


def test_flops_by_hand() -> None:
    context = 3  # causal: (3 + 1) / 2 = 2 keys on average, 4 * d * 2 = 64 FLOPs a layer
    assert pe.attention_flops(TINY, context) == 64
    # per block 2 * 576 + 64 = 1216; the head 2 * 32 * 8 = 512
    assert pe.forward_flops(TINY, context, depth=2, lm_head=False) == 2432
    assert pe.forward_flops(TINY, context, depth=1, lm_head=True) == 1216 + 512
    # backward to inputs: matmuls again (1152) and attention twice (128) per block, the head's input grad 512
    assert pe.backward_flops(TINY, context, blocks=2) == 2 * 1280 + 512
    # weight gradients add the matmuls and the head once more
    assert pe.backward_flops(TINY, context, blocks=2, weight_grads=True) == 2 * (1280 + 1152) + 1024
    layers = [0, 1]
    assert pe.stage_flops(TINY, context, "raw", layers) == 2432
    assert pe.stage_flops(TINY, context, "hidden", [0]) == 1216  # stops after the deepest requested layer
    assert pe.stage_flops(TINY, context, "attention", layers) == 2432 + 2 * 2 * 8 * 3  # full T x T recompute
    # S2: forward to the head (2944), backward from layer 0's output through block 1 and the head (1792)
    assert pe.stage_flops(TINY, context, "gradient", layers) == 2944 + 1792
    assert pe.stage_flops(TINY, context, "forward_backward", layers) == 2944 + 3072


def test_budget_picks_rows_by_hand() -> None:
    # bf16 activations, float32 captures: captured 2*2*8*4 = 128, block 2*(8*8 + 4*16) = 256 -> 384 B/token
    costs = pe.stage_token_costs(TINY, "hidden", [0, 1], itemsize=2, out_itemsize=4)
    assert costs.plain == 384
    # a quarter of 1 MB free over 384 B/token: 651 tokens, under the 8192 cap; 651 // 100 = 6 rows of 100
    budget = pe.budget_tokens(TINY, [0, 1], 1_000_000, itemsize=2, out_itemsize=4)
    assert budget == 651
    assert pe.rows_per_forward(costs, budget, 100) == 6
    assert pe.chunk_bytes(costs, 6, 100) == 6 * 100 * 384
    # the raw forward captures nothing: its token costs one block's work
    assert pe.stage_token_costs(TINY, "raw", [0, 1], itemsize=2, out_itemsize=4).plain == 256


def test_llama_budget_and_rows_by_hand() -> None:
    layers = list(range(32))
    # plain: 2*32*4096*4 = 1,048,576 captured + 2*(8*4096 + 4*14336) = 180,224 block
    hidden = pe.stage_token_costs(pe.LLAMA_31_8B, "hidden", layers, itemsize=2, out_itemsize=4)
    assert hidden.plain == 1_228_800
    # 80 GB - 16.06 GB weights - 1 GB context, a quarter of it is ~12,800 tokens: the 8192 cap binds
    free = int(80e9 - pe.parameter_count(pe.LLAMA_31_8B) * 2 - 1e9)
    budget = pe.budget_tokens(pe.LLAMA_31_8B, layers, free, itemsize=2, out_itemsize=4)
    assert budget == 8192
    assert pe.rows_per_forward(hidden, budget, 400) == 20  # 8192 // 400
    # attention, recomputed in query chunks: 4*(4*32 + 32*128) + 4 = 16,900 B per token (the estimate's shape
    # passes no KV heads: all 32 stand in) and one 256 MiB chunk, no term in length^2: it cuts no rows (was 17)
    attention = pe.stage_token_costs(pe.LLAMA_31_8B, "attention", layers, itemsize=2, out_itemsize=4)
    assert (attention.attention_per_key, attention.attention_per_token) == (0, 16_900)
    assert pe.rows_per_forward(attention, budget, 400) == 20
    # S2's graph: 32 blocks of 2*(3*14336 + 3*4096 + 2*4096) + 4*2*4096 = 159,744 B: 5,111,808 B/token (the
    # estimate's shape passes no KV width: the full hidden size stands in); S2 no longer cuts the chunk
    everything = pe.stage_token_costs(pe.LLAMA_31_8B, "all", layers, itemsize=2, out_itemsize=4)
    assert everything.gradient == 5_111_808
    assert pe.rows_per_forward(everything, budget, 400) == 20
    # without the budget a batch of 32 x 400 would hold 81.6 GB (the T x T attention map's 204,800 B a token is
    # gone; one 256 MiB query chunk instead): more than the card
    assert pe.chunk_bytes(everything, 32, 400) == 32 * 400 * (1_228_800 + 16_900 + 5_111_808) + 256 * 2**20


def test_transferred_ratio_carries_the_measured_overhead() -> None:
    # the reference measured 2.8x where its FLOPs say 2.5x: 12% overhead on the target's 2.0x
    assert pe.transferred_ratio(2.0, 2.5, 2.8) == pytest.approx(2.24)


def _measured(raw_peak: int, stage_peak: int) -> dict:
    config = {"model": "x", "n_layers": 30, "hidden_size": 576, "layers": list(range(30)), "pack_to": 256,
              "max_length": 256, "dtype": "torch.float32", "batch_size": 32, "padded_tokens": 2048,
              "max_batch_tokens": 8192}
    return {"config": config, "stages": {
        "raw": {"cpu_over_raw": 1.0, "peak_bytes": raw_peak, "max_batch_tokens": 8192},
        "hidden": {"cpu_over_raw": 1.05, "peak_bytes": stage_peak, "max_batch_tokens": 8192},
        "gradient": {"cpu_over_raw": 2.6, "peak_bytes": stage_peak, "max_batch_tokens": 7246}}}


def test_validation_predicts_peak_from_the_raw_stage() -> None:
    # SmolLM2 float32: raw 8 rows x 256 of a block (4*(8*576 + 4*1536) = 43,008 B); hidden adds 2*30*576*4 =
    # 138,240 B a token of captures, so its peak is the raw peak + 2048 * 138,240
    raw, hidden, gradient = pe.validate(_measured(10**9, 2 * 10**9))
    assert raw.predicted_peak_bytes == 10**9
    assert hidden.predicted_peak_bytes == 10**9 + 2048 * 138_240
    assert hidden.flop_ratio == 1.0
    assert hidden.measured_cpu_ratio == 1.05
    # S2 at that stage's own budget of 7246 tokens (28 rows of 256, the batch's 8): its graph, 30 blocks of
    # 4*(3*1536 + 3*576 + 2*576) + 4*2*576 = 34,560 B = 1,036,800 B/token, never cuts the chunk (batching)
    assert gradient.predicted_peak_bytes == 10**9 - 2048 * 43_008 + 8 * 256 * (181_248 + 1_036_800)


def test_unknown_reference_model_stops_in_one_line() -> None:
    measured = _measured(1, 1)
    measured["config"]["hidden_size"] = 100
    with pytest.raises(SystemExit, match=r"no shape paper_estimate\.py knows"):
        pe.shape_of(measured)


def test_estimate_carries_overhead_and_adds_the_host() -> None:
    measured = _measured(10**9, 10**9)
    smol_gradient = pe.stage_flops(pe.SMOLLM2_135M, 256, "gradient", list(range(30))) / pe.stage_flops(
        pe.SMOLLM2_135M, 256, "raw", list(range(30)))
    measured["stages"]["hidden"]["cpu_over_raw"] = 1.1  # 10% beyond SmolLM2's FLOP ratio of 1
    measured["stages"]["gradient"]["cpu_over_raw"] = smol_gradient  # no overhead beyond the FLOPs
    budget, stages = pe.estimate(pe.LLAMA_31_8B, measured, context=400, layers=list(range(32)), itemsize=2,
                                 out_itemsize=4, device_bytes=80e9, mfu=0.5, peak_flops=1e15, host_bandwidth=25e9,
                                 batch_size=32, corpus_tokens=1000, host_pool_seconds=1e-5)
    by = {s.stage: s for s in stages}
    raw_flops = pe.stage_flops(pe.LLAMA_31_8B, 400, "raw", list(range(32)))
    assert budget == 8192
    assert by["raw"].tokens_per_s == pytest.approx(5e14 / raw_flops)
    assert by["hidden"].ratio == pytest.approx(1.1)
    assert by["gradient"].ratio == pytest.approx(by["gradient"].flop_ratio)
    # the host: 32 * 4096 * 4 = 524,288 B at 25 GB/s and 10 us of pooling a token, after the GPU's 1.1 raw tokens
    hidden_seconds = 1.1 * raw_flops / 5e14 + 524_288 / 25e9 + 1e-5
    assert by["hidden"].host_tokens_per_s == pytest.approx(1 / hidden_seconds)
    assert by["hidden"].corpus_hours == pytest.approx(1000 * hidden_seconds / 3600)
    assert by["raw"].host_tokens_per_s == pytest.approx(by["raw"].tokens_per_s)  # the baseline copies nothing
    # S2 at 2 rows of 400 beside 16,060,522,496 B of weights
    assert by["gradient"].peak_bytes == 16_060_522_496 + 20 * 400 * (1_228_800 + 5_111_808)
