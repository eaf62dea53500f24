"""The first position as an attention sink: which passages drop it from pooling, per layer (pure arrays).

A causal LM's first position attends only to itself, so its state carries no passage context, and many
models turn it into a massive-activation sink. Measured on SmolLM2-135M-Instruct (no BOS; 16 imdb passages,
median 30 tokens): ||h_0|| / median ||h_t>0|| is 1.3 at layer 0, 3.4 at 1, 8-9 at 2-7, 4.8 at 8, 1.0-1.1 at
9-10, 100-170 at 11-20, 34-94 at 21-27, 12 and 6 at 28-29; at layers 11-27 h_0 alone is 71-92% of the
norm of the A1 mean and 55-85% of A4's weight. Random-weight and BOS-trained toy models stay below 2.

Modes (a strategy's `sink` param): "keep" pools every real token; "skip" drops the first real token of
every passage that has another; "auto" (the default of A1-A4 and S1) drops it at a layer only where its
norm is at least SINK_RATIO times the median norm of the passage's other real tokens (at least AUTO_OTHERS
of them: one other token is no baseline for an outlier), so a model without a sink pools exactly as "keep".
Attention weights (S1) also drop it where the heads still treat it as a sink after its norm has collapsed
(SmolLM2 layers 9-10: 58% and 20% of the inflow at norm ratio ~1): where its inflow, divided by what causal
masking alone would give it under uniform attention, is SINK_RATIO times the median of the same ratio over
the other real tokens.
"""

from __future__ import annotations

import warnings

import numpy as np

SINK_MODES = ("auto", "skip", "keep")
DEFAULT_SINK_MODE = "auto"
# Between the largest non-sink ratio measured (2.0 on SmolLM2 layer 0, below 2 on the toy models) and the
# smallest sink ratio of a formed sink (3.7, SmolLM2 layer 8); layer 1 (2.3-5.4) is a sink forming.
SINK_RATIO = 4.0
AUTO_OTHERS = 2


def first_positions(mask: np.ndarray) -> np.ndarray:
    """[B] index of each passage's first real token, whatever the padding side."""
    return np.asarray(mask, dtype=bool).argmax(axis=1)


def first_token_norm_ratio(norms: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[L, B] ||h_first|| / median ||h_t|| over the passage's other real tokens; NaN for one-token passages."""
    mask = np.asarray(mask, dtype=bool)
    first = first_positions(mask)
    rows = np.arange(mask.shape[0])
    others = mask.copy()
    others[rows, first] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # one-token passages: median of nothing is NaN
        median = np.nanmedian(np.where(others, norms, np.nan), axis=-1)
        return norms[:, rows, first] / median


def sink_rows(norms: np.ndarray, mask: np.ndarray, mode: str) -> np.ndarray:
    """[L, B] True where the passage's first real token is left out at that layer under `mode`."""
    mask = np.asarray(mask, dtype=bool)
    shape = (norms.shape[0], mask.shape[0])
    if mode == "keep":
        return np.zeros(shape, dtype=bool)
    lengths = mask.sum(axis=1)
    if mode == "skip":
        return np.broadcast_to(lengths >= 2, shape).copy()
    with np.errstate(invalid="ignore"):
        return (lengths > AUTO_OTHERS) & (first_token_norm_ratio(norms, mask) >= SINK_RATIO)


def drop_first(weights: np.ndarray, mask: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`weights` ([B,T] or [L,B,T]) with the first real token zeroed where `rows` [L,B] says; unchanged
    (same array, same shape) when no row drops it, so a model without a sink pools bit for bit as before."""
    if not rows.any():
        return weights
    out = np.array(np.broadcast_to(weights, (rows.shape[0], *np.shape(mask))), dtype=np.float32)
    layer, passage = np.nonzero(rows)
    out[layer, passage, first_positions(mask)[passage]] = 0.0
    return out


def uniform_causal_inflow(mask: np.ndarray, queries: str) -> np.ndarray:
    """[B, T] the weight each real token would get if every query attended uniformly to the keys it may see:
    averaged over all real queries, key j of n gets (H_n - H_j) / n; seen by the last query alone, 1 / n."""
    mask = np.asarray(mask, dtype=bool)
    lengths = mask.sum(axis=1)
    position = np.cumsum(mask, axis=1) - 1  # a real token's index among its passage's real tokens
    if queries == "last":
        out = np.where(mask, 1.0 / np.maximum(lengths, 1)[:, None], 0.0)
        return out
    harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, mask.shape[1] + 1))])
    n = lengths[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (harmonic[n] - harmonic[np.clip(position, 0, None)]) / n
    return np.where(mask, out, 0.0)


def attention_sink_rows(weights: np.ndarray, mask: np.ndarray, queries: str) -> np.ndarray:
    """[L, B] True where the first real token's attention inflow, relative to its uniform causal share, is at
    least SINK_RATIO times the median relative inflow of the passage's other real tokens."""
    mask = np.asarray(mask, dtype=bool)
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim == 2:
        weights = weights[None]
    relative = np.where(mask, weights / np.where(mask, uniform_causal_inflow(mask, queries), 1.0), np.nan)
    first = first_positions(mask)
    rows = np.arange(mask.shape[0])
    others = relative.copy()
    others[:, rows, first] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(others, axis=-1)
        ratio = relative[:, rows, first] / median
    with np.errstate(invalid="ignore"):
        return (mask.sum(axis=1) > AUTO_OTHERS) & (ratio >= SINK_RATIO)
