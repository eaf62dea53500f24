"""Saliency-weighted strategies: attention inflow (S1), gradient saliency (S2), the reference's SIF weights.

S1_attention: a token's weight is the attention it receives at the probed layer's self-attention,
  mean over heads of mean over the passage's real query positions i of A[h, i, t]. Each attention row sums
  to 1 over the keys a query may see, so the weights form a distribution; on a causal LM early tokens are
  seen by more queries and receive more. `sink="auto"` (poolbench.pooler.sink) leaves the first token out
  where its hidden state is a massive-activation sink (on SmolLM2 it takes 44-91% of the inflow at layers
  11-27) and where its inflow far exceeds its uniform causal share though its norm has collapsed (layers 9-10:
  58% and 20%); `sink="skip"` always leaves it out.
S1_attention_last_query: the same with the last real query position only (what the next token reads).
S2_gradient: weight = ||d s / d h_t|| at the probed layer, s = sum over the passage's real tokens of log
  p(x_{t+1} | x_<=t) under the model itself (label-free); one backward per batch serves every layer.
  The last token predicts nothing inside the passage, so its weight is 0. Encoders have no passage
  likelihood and are refused with a one-line error.
S2_gradient_x_input: weight = |<h_t, d s / d h_t>| (input x gradient, absolute so weights are >= 0).
S2_sif / S2_sif_pc1 (reference variants): weight a / (a + p(token)), a = 1e-3, p the unigram frequency of
  the model token over the concept's train split, special tokens included; an id never seen there gets p = a
  (weight 1/2), as the reference. _pc1 then removes, per layer and per split, the first principal component
  of that split's pooled vectors (centred, as sklearn's PCA(1)) from each of them: v - (v . u) u.
"""

from __future__ import annotations

import numpy as np

from poolbench.errors import StrategyError
from poolbench.pooler.sink import DEFAULT_SINK_MODE
from poolbench.pooler.spec import StrategySpec, TokenContext

SIF_A = 1e-3


def _extra(ctx: TokenContext, name: str, need: str) -> np.ndarray:
    if name not in ctx.extras:
        raise StrategyError(f"batch has no extras[{name!r}]: this strategy needs {need!r} at extraction")
    return np.asarray(ctx.extras[name])


def attention_inflow_weights(ctx: TokenContext) -> np.ndarray:
    return _extra(ctx, "attention_inflow", "attention")


def attention_last_query_weights(ctx: TokenContext) -> np.ndarray:
    return _extra(ctx, "attention_inflow_last", "attention")


def gradient_norm_weights(ctx: TokenContext) -> np.ndarray:
    return _extra(ctx, "gradient_norm", "gradient")


def gradient_x_input_weights(ctx: TokenContext) -> np.ndarray:
    return _extra(ctx, "gradient_x_input", "gradient")


def sif_weights(ctx: TokenContext) -> np.ndarray:
    return SIF_A / (SIF_A + _extra(ctx, "unigram_probability", "corpus"))


def remove_first_component(vectors: np.ndarray, fit_rows: np.ndarray) -> np.ndarray:
    """v - u u^T v with u the first principal axis of the fit rows (centred, as sklearn's PCA; the vectors
    themselves are projected uncentred, as the reference does)."""
    fit = np.asarray(vectors[fit_rows], dtype=np.float64)
    if len(fit) == 0:
        return vectors
    _, _, vt = np.linalg.svd(fit - fit.mean(axis=0), full_matrices=False)
    u = vt[0]
    return (vectors - np.outer(vectors @ u, u)).astype(vectors.dtype)


SPECS = (
    StrategySpec(
        id="S1_attention", code="S1", family="saliency_weighted", kind="weights",
        weights_fn=attention_inflow_weights, needs=frozenset({"attention"}), params=(("sink", DEFAULT_SINK_MODE),),
        attention_queries="all", version=2,
        description="Tokens weighted by the attention they receive at the probed layer, mean over heads and "
                    "over the passage's real query positions.",
    ),
    StrategySpec(
        id="S1_attention_last_query", code="S1", family="saliency_weighted", kind="weights",
        weights_fn=attention_last_query_weights, needs=frozenset({"attention"}), variant_of="S1_attention",
        params=(("sink", DEFAULT_SINK_MODE),), attention_queries="last", version=2,
        description="Tokens weighted by the attention the last real token pays them at the probed layer, "
                    "mean over heads.",
    ),
    StrategySpec(
        id="S2_gradient", code="S2", family="saliency_weighted", kind="weights",
        weights_fn=gradient_norm_weights, needs=frozenset({"gradient"}),
        description="Tokens weighted by the L2 norm of the gradient of the passage's own LM log-likelihood "
                    "with respect to their hidden state at the probed layer.",
    ),
    StrategySpec(
        id="S2_gradient_x_input", code="S2", family="saliency_weighted", kind="weights",
        weights_fn=gradient_x_input_weights, needs=frozenset({"gradient"}), variant_of="S2_gradient",
        description="Tokens weighted by |hidden . gradient| of the passage's LM log-likelihood at the probed "
                    "layer (input x gradient).",
    ),
    StrategySpec(
        id="S2_sif", code="S2", family="saliency_weighted", kind="weights", weights_fn=sif_weights,
        needs=frozenset({"corpus"}), reference_variant=True, version=2,
        params=(("a", SIF_A), ("remove_first_pc", False)),
        description="Reference variant: SIF weights a/(a+p(token)), a=1e-3, p the token's unigram frequency "
                    "over the concept's train split.",
    ),
    StrategySpec(
        id="S2_sif_pc1", code="S2", family="saliency_weighted", kind="weights", weights_fn=sif_weights,
        needs=frozenset({"corpus"}), reference_variant=True, version=2,
        params=(("a", SIF_A), ("remove_first_pc", True)),
        description="Reference variant: SIF weights, then the first principal component (centred) of each "
                    "split's pooled vectors removed from them, per layer.",
    ),
)


def check_encoder_support(kind: str, specs) -> None:
    """S2 needs a causal LM's passage likelihood; refuse encoders in one line naming the strategy."""
    if kind != "causal":
        bad = [s.id for s in specs if "gradient" in s.needs]
        if bad:
            raise StrategyError(f"strategy {bad[0]!r} needs a causal LM's log-likelihood; this model is an "
                                f"{kind} (drop {', '.join(bad)})")
