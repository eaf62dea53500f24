"""Uniform aggregation over real tokens: mean, elementwise max/min, and L2-norm-weighted mean.

All four carry `sink="auto"` (poolbench.pooler.sink): on SmolLM2 the first token's massive activation is
71-92% of the A1 mean's norm and 55-85% of A4's weight at layers 11-27, so where it is a sink it is left out;
on a model without a sink nothing changes.
"""

from __future__ import annotations

import numpy as np

from poolbench.pooler.sink import DEFAULT_SINK_MODE
from poolbench.pooler.spec import StrategySpec, TokenContext

SINK = (("sink", DEFAULT_SINK_MODE),)


def all_token_weights(ctx: TokenContext) -> np.ndarray:
    return ctx.attention_mask


def norm_weights(ctx: TokenContext) -> np.ndarray:
    """Per-layer token L2 norms [L,B,T], shared with the sink rule so they are computed once per batch."""
    return ctx.token_norms


SPECS = (
    StrategySpec(
        id="A1_mean", code="A1", family="uniform_aggregation", kind="weights", weights_fn=all_token_weights,
        params=SINK,
        description="Mean of the hidden states of all non-pad tokens, special tokens included, the first "
                    "token left out where it is an attention sink.",
    ),
    StrategySpec(
        id="A2_max", code="A2", family="uniform_aggregation", kind="reduction", reduction="max", params=SINK,
        description="Elementwise maximum over all non-pad tokens' hidden states, the first token left out "
                    "where it is an attention sink.",
    ),
    StrategySpec(
        id="A3_min", code="A3", family="uniform_aggregation", kind="reduction", reduction="min", params=SINK,
        description="Elementwise minimum over all non-pad tokens' hidden states, the first token left out "
                    "where it is an attention sink.",
    ),
    StrategySpec(
        id="A4_norm_weighted", code="A4", family="uniform_aggregation", kind="weights",
        weights_fn=norm_weights, params=SINK,
        description="Mean of non-pad tokens weighted by each token's L2 norm at that same layer, the first "
                    "token left out where it is an attention sink.",
    ),
)
