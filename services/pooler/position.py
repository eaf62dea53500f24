"""Position-anchored strategies: one token chosen by where it sits among the passage's real tokens.

Special tokens count as real, so on a Llama-style tokenizer (BOS prepended) P2_first is the BOS token.
"""

from __future__ import annotations

import numpy as np

from poolbench.pooler.spec import StrategySpec, TokenContext


def last_token_weights(ctx: TokenContext) -> np.ndarray:
    return ctx.rank == (ctx.lengths[:, None] - 1)


def first_token_weights(ctx: TokenContext) -> np.ndarray:
    return ctx.rank == 0


SPECS = (
    StrategySpec(
        id="P1_last", code="P1", family="position_anchored", kind="weights", weights_fn=last_token_weights,
        description="Hidden state of the last non-pad token (the one a causal LM has read everything by).",
    ),
    StrategySpec(
        id="P2_first", code="P2", family="position_anchored", kind="weights", weights_fn=first_token_weights,
        description="Hidden state of the first non-pad token; special tokens count, so with a BOS "
                    "tokenizer this is the BOS token.",
    ),
)
