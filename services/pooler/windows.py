"""Window strategies: the mean of a contiguous run of real tokens, or a mean of chunk means (W4).

Positions are ranks among a passage's real tokens, so left and right padding give the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from poolbench.errors import StrategyError
from poolbench.pooler.spec import StrategySpec, TokenContext

DEFAULT_K = 8
DEFAULT_N_CHUNKS = 4


def first_k_weights(ctx: TokenContext, k: int) -> np.ndarray:
    return (ctx.rank >= 0) & (ctx.rank < k)


def last_k_weights(ctx: TokenContext, k: int) -> np.ndarray:
    return (ctx.rank >= 0) & (ctx.rank >= ctx.lengths[:, None] - k)


def middle_k_weights(ctx: TokenContext, k: int) -> np.ndarray:
    """The k tokens centred on the middle; when they cannot sit exactly centred they sit one token earlier."""
    start = np.maximum((ctx.lengths - k) // 2, 0)[:, None]
    return (ctx.rank >= start) & (ctx.rank < start + k)


def hierarchical_weights(ctx: TokenContext, n_chunks: int) -> np.ndarray:
    """Mean of chunk means as token weights; chunks follow np.array_split (the first n % c are one longer)."""
    chunks = np.maximum(np.minimum(n_chunks, ctx.lengths), 1)[:, None]
    size, longer = np.divmod(ctx.lengths[:, None], chunks)
    chunk_size = np.where(ctx.rank < longer * (size + 1), size + 1, size)
    weights = np.zeros(ctx.rank.shape, dtype=np.float32)
    real = ctx.rank >= 0
    weights[real] = (1.0 / (chunks * np.maximum(chunk_size, 1)))[real]
    return weights


_WINDOWS: dict[str, tuple[str, str, Callable[..., np.ndarray], str, int, str]] = {
    "W1": ("W1_first_k", "k", first_k_weights, "Mean of the first {} non-pad tokens", DEFAULT_K, ""),
    "W2": ("W2_last_k", "k", last_k_weights, "Mean of the last {} non-pad tokens", DEFAULT_K, ""),
    "W3": ("W3_middle_k", "k", middle_k_weights,
           "Mean of the {} non-pad tokens centred on the passage's middle (one earlier if uneven)",
           DEFAULT_K, ""),
    "W4": ("W4_hierarchical", "n_chunks", hierarchical_weights,
           "Mean of the means of {} contiguous near-equal chunks of the non-pad tokens",
           DEFAULT_N_CHUNKS, "_c"),
}


def window_spec(code: str, **params: int) -> StrategySpec:
    """A window strategy with its size param; a non-default size gets its own id, e.g. W2_last_k16 or
    W4_hierarchical_c8, so two sizes can be pooled side by side."""
    if code not in _WINDOWS:
        raise StrategyError(f"unknown window strategy code {code!r} (known: {', '.join(_WINDOWS)})")
    base_id, name, rule, description, default, suffix = _WINDOWS[code]
    unknown = set(params) - {name}
    if unknown:
        raise StrategyError(f"window strategy {code}: unknown param(s) {sorted(unknown)} (only {name!r})")
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(f"window strategy {code}: {name} must be a positive int, got {value!r}")
    strategy_id = base_id if value == default else f"{base_id}{suffix}{value}"
    return StrategySpec(
        id=strategy_id, code=code, family="window", kind="weights",
        weights_fn=partial(rule, **{name: value}), params=((name, value),),
        description=f"{description.format(value)}; a passage with fewer tokens uses all of them.",
    )


SPECS = tuple(window_spec(code) for code in _WINDOWS)
