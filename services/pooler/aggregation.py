"""Uniform aggregation over all real tokens: mean, elementwise max/min, and L2-norm-weighted mean."""

from __future__ import annotations

import numpy as np
import torch

from poolbench.pooler.spec import StrategySpec, TokenContext


def all_token_weights(ctx: TokenContext) -> np.ndarray:
    return ctx.attention_mask


def norm_weights(ctx: TokenContext) -> np.ndarray:
    """Per-layer token L2 norms [L,B,T]; torch reduces without materialising a squared copy of hidden."""
    hidden = torch.from_numpy(np.asarray(ctx.hidden))
    return torch.linalg.vector_norm(hidden, dim=-1).numpy()


SPECS = (
    StrategySpec(
        id="A1_mean", code="A1", family="uniform_aggregation", kind="weights", weights_fn=all_token_weights,
        description="Mean of the hidden states of all non-pad tokens, special tokens included.",
    ),
    StrategySpec(
        id="A2_max", code="A2", family="uniform_aggregation", kind="reduction", reduction="max",
        description="Elementwise maximum over all non-pad tokens' hidden states.",
    ),
    StrategySpec(
        id="A3_min", code="A3", family="uniform_aggregation", kind="reduction", reduction="min",
        description="Elementwise minimum over all non-pad tokens' hidden states.",
    ),
    StrategySpec(
        id="A4_norm_weighted", code="A4", family="uniform_aggregation", kind="weights",
        weights_fn=norm_weights,
        description="Mean of non-pad tokens weighted by each token's L2 norm at that same layer.",
    ),
)
