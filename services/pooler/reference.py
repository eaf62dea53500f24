"""The reference code's variants, registered under their own ids so results compare with its leaderboard.

They are `reference_variant=True`: reached by id only, never part of a default run.
- P3_first_content: the first non-special token whose text holds a letter or digit (skips BOS, punctuation).
- A3_random: mean over a random half (floor, at least one) of the real tokens; the generator is seeded by a
  sha256 of the passage id, so every run, batch and metric sees the same positions.
- W1/W2/W3_ref_last4/8/16: what the reference called W1-W3, the mean of the last 4, 8 and 16 tokens.
- W4_ref_remainder: the reference's W4, chunks of c = max(1, T // 4) tokens starting at 0, c, 2c, ... (the last
  one shorter), mean of the chunk means: ceil(T / c) chunks, so T mod 4 > T // 4 makes more than five (T = 6 or 7:
  one-token chunks, the plain mean; T = 11: chunks of 2, 2, 2, 2, 2, 1).
- A4_norm: the reference's A4, the plain mean of the unit vectors h_t / (|h_t| + 1e-9) over all real tokens
  (divide_by="token_count": the weights 1 / (|h_t| + 1e-9) are summed over T, not over their own total).
- P3_ref_position1: the reference's P3_CLS, the token at position 1 (after BOS), position 0 in a one-token passage.
- A1_ref_mean, A2_ref_max, S1_ref_attention: the card's A1, A2 and S1 with the first token always kept
  (sink="keep"), as the reference pools: no attention-sink rule.
The token rules (L3_named_entity, L4_subword_root, L5_svo) are in poolbench.pooler.reference_tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from functools import partial

import numpy as np

from poolbench.pooler import aggregation, saliency
from poolbench.pooler.spec import StrategySpec, TokenContext
from poolbench.pooler.windows import last_k_weights


def passage_seed(passage_id: str) -> int:
    """A stable 64-bit seed from the passage id (Python's hash() changes between processes)."""
    return int.from_bytes(hashlib.sha256(passage_id.encode()).digest()[:8], "little")


def first_content_weights(ctx: TokenContext) -> np.ndarray:
    weights = np.zeros(ctx.attention_mask.shape, dtype=bool)
    for b, text in enumerate(ctx.texts):
        for t in np.flatnonzero(ctx.attention_mask[b] & ~ctx.special_mask[b]):
            start, end = ctx.offsets[b, t]
            if any(ch.isalnum() for ch in text[start:end]):
                weights[b, t] = True
                break
    return weights


def random_half_weights(ctx: TokenContext) -> np.ndarray:
    weights = np.zeros(ctx.attention_mask.shape, dtype=bool)
    for b, passage_id in enumerate(ctx.passage_ids):
        n = int(ctx.lengths[b])
        if n == 0:
            continue
        chosen = np.random.default_rng(passage_seed(passage_id)).choice(n, size=max(n // 2, 1), replace=False)
        weights[b] = np.isin(ctx.rank[b], chosen)
    return weights


def remainder_chunk_weights(ctx: TokenContext, n_chunks: int = 4) -> np.ndarray:
    size = np.maximum(ctx.lengths[:, None] // n_chunks, 1)
    count = -(-ctx.lengths[:, None] // size)  # ceil(T / size) chunks, the last one holding what is left
    chunk = np.maximum(ctx.rank, 0) // size
    chunk_size = np.minimum(size, ctx.lengths[:, None] - chunk * size)
    weights = np.zeros(ctx.rank.shape, dtype=np.float64)
    real = ctx.rank >= 0
    weights[real] = (1.0 / (count * np.maximum(chunk_size, 1)))[real]
    return weights


NORM_EPS = 1e-9  # the reference's guard in h / (|h| + eps)


def inverse_norm_weights(ctx: TokenContext) -> np.ndarray:
    """[L, B, T] 1 / (|h_t| + eps): with divide_by="token_count" the pooled vector is the mean of unit vectors."""
    return 1.0 / (ctx.token_norms + NORM_EPS)


def position_one_weights(ctx: TokenContext) -> np.ndarray:
    return ctx.rank == np.minimum(1, ctx.lengths[:, None] - 1)


def _sink_kept(card_id: str, strategy_id: str, description: str) -> StrategySpec:
    card = next(spec for spec in (*aggregation.SPECS, *saliency.SPECS) if spec.id == card_id)
    return replace(card.with_sink_mode("keep"), id=strategy_id, reference_variant=True, description=description)


def _ref(strategy_id: str, fn, family: str, description: str, params: tuple = (), **fields) -> StrategySpec:
    return StrategySpec(id=strategy_id, code=strategy_id.split("_", 1)[0], family=family, kind="weights",
                        weights_fn=fn, description=description, params=params, reference_variant=True, **fields)


SPECS = (
    _ref("P3_first_content", first_content_weights, "position_anchored",
         "Reference variant: the first non-special token whose text holds a letter or digit."),
    _ref("A3_random", random_half_weights, "uniform_aggregation",
         "Reference variant: mean over a random half of the real tokens, seeded by the passage id's sha256."),
    *(_ref(f"{code}_ref_last{k}", partial(last_k_weights, k=k), "window",
           f"Reference variant: the reference's {code}, the mean of the last {k} non-pad tokens.",
           (("k", k),))
      for code, k in (("W1", 4), ("W2", 8), ("W3", 16))),
    _ref("W4_ref_remainder", remainder_chunk_weights, "window",
         "Reference variant: chunks of max(1, T // 4) tokens from the start (the last one shorter), mean of "
         "the chunk means; T = 6, 7 give the plain mean.", version=2),
    _ref("P3_ref_position1", position_one_weights, "position_anchored",
         "Reference variant: the reference's P3_CLS, the hidden state at position 1 (the first token after BOS; "
         "position 0 in a one-token passage)."),
    _sink_kept("A1_mean", "A1_ref_mean", "Reference variant: mean of all non-pad tokens, the first one always kept."),
    _sink_kept("A2_max", "A2_ref_max",
               "Reference variant: elementwise maximum over all non-pad tokens, the first one always kept."),
    _sink_kept("S1_attention", "S1_ref_attention",
               "Reference variant: tokens weighted by their attention inflow (mean over heads and real queries), "
               "the first token always kept."),
    _ref("A4_norm", inverse_norm_weights, "uniform_aggregation",
         "Reference variant: the mean over all real tokens of the unit vectors h_t / (|h_t| + 1e-9).",
         divide_by="token_count"),
)
