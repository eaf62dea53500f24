"""pool_naive: a deliberately plain reference for pool_tokens, written from each strategy's definition.

Built-in codes are re-implemented here on a passage's real-token slice (no weights, no rank tricks), so
agreement with pool_tokens checks the weight rules as well as the contraction; other codes, and the variants
sharing a card code (reference and named variants), use weights_fn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.pool import PooledBatch
from poolbench.pooler.sink import AUTO_OTHERS, SINK_RATIO
from poolbench.pooler.spec import StrategySpec, TokenContext


def _norm_weighted(tokens: np.ndarray) -> np.ndarray | None:
    norms = np.array([np.sqrt(np.sum(token ** 2)) for token in tokens])
    if norms.sum() == 0:
        return None
    return (norms[:, None] * tokens).sum(axis=0) / norms.sum()


def _middle(tokens: np.ndarray, k: int) -> np.ndarray:
    n = len(tokens)
    start = (n - k) // 2 if n > k else 0
    return tokens[start:start + k].mean(axis=0)


def _hierarchical(tokens: np.ndarray, n_chunks: int) -> np.ndarray:
    chunks = np.array_split(tokens, min(n_chunks, len(tokens)))
    return np.mean([chunk.mean(axis=0) for chunk in chunks], axis=0)


_RULES: dict[str, Callable[[np.ndarray, StrategySpec], np.ndarray | None]] = {
    "P1": lambda x, spec: x[-1],
    "P2": lambda x, spec: x[0],
    "A1": lambda x, spec: x.mean(axis=0),
    "A2": lambda x, spec: x.max(axis=0),
    "A3": lambda x, spec: x.min(axis=0),
    "A4": lambda x, spec: _norm_weighted(x),
    "W1": lambda x, spec: x[:spec.param("k")].mean(axis=0),
    "W2": lambda x, spec: x[-spec.param("k"):].mean(axis=0),
    "W3": lambda x, spec: _middle(x, spec.param("k")),
    "W4": lambda x, spec: _hierarchical(x, spec.param("n_chunks")),
}


def _first_is_left_out(tokens: np.ndarray, mode: str) -> bool:
    """The sink rule read plainly: never for one token; always with "skip"; with "auto" when at least
    AUTO_OTHERS other tokens exist and the first token's norm is at least SINK_RATIO times their median."""
    if mode == "keep" or len(tokens) < 2:
        return False
    if mode == "skip":
        return True
    norms = np.linalg.norm(tokens, axis=1)
    return len(tokens) > AUTO_OTHERS and bool(norms[0] >= SINK_RATIO * np.median(norms[1:]))


def _attention_sink(inflow: np.ndarray, queries: str) -> bool:
    """The attention sink rule read plainly: each token's inflow over its uniform causal share (the mean of
    1/(i+1) over the queries i that see it), the first token's ratio against the others' median."""
    n = len(inflow)
    if n <= AUTO_OTHERS:
        return False
    if queries == "last":
        share = np.full(n, 1.0 / n)
    else:
        share = np.array([sum(1.0 / (i + 1) for i in range(j, n)) / n for j in range(n)])
    relative = inflow / share
    return bool(relative[0] >= SINK_RATIO * np.median(relative[1:]))


def pool_naive(batch: ActivationBatch, specs: Sequence[StrategySpec]) -> PooledBatch:
    """Per passage, per strategy, per layer loops over the passage's real tokens; same output as pool_tokens.
    A rule that selects nothing (None, or all-zero weights) falls back to the mean and is flagged."""
    specs = list(specs)
    n_layers, batch_size, _, dim = batch.hidden.shape
    vectors = np.zeros((n_layers, len(specs), batch_size, dim), dtype=np.float32)
    fallback = np.zeros((len(specs), batch_size), dtype=bool)
    ctx = TokenContext.from_batch(batch)
    for s, spec in enumerate(specs):
        own_rule = spec.code in _RULES and (spec.kind == "reduction" or (not spec.reference_variant
                                                                          and spec.variant_of is None))
        custom = None if own_rule else np.asarray(spec.weights_fn(ctx), dtype=np.float64)
        for b in range(batch_size):
            real = np.flatnonzero(batch.attention_mask[b])
            for layer in range(n_layers):
                tokens = batch.hidden[layer, b, real].astype(np.float64)
                start = 1 if _first_is_left_out(tokens, spec.sink_mode) else 0
                if custom is not None and spec.sink_mode == "auto" and spec.attention_queries is not None:
                    inflow = (custom if custom.ndim == 2 else custom[layer])[b, real]
                    start = max(start, int(_attention_sink(inflow, spec.attention_queries)))
                if custom is None:
                    vector = _RULES[spec.code](tokens[start:], spec)
                else:
                    weights = (custom if custom.ndim == 2 else custom[layer])[b, real][start:]
                    total = weights.sum()
                    divisor = total if spec.divide_by == "weight_sum" else len(weights)
                    vector = None if total == 0 else (weights[:, None] * tokens[start:]).sum(axis=0) / divisor
                if vector is None:
                    fallback[s, b] = True
                    vector = tokens.mean(axis=0)
                vectors[layer, s, b] = vector
    return PooledBatch(vectors=vectors, strategy_ids=[spec.id for spec in specs], layers=tuple(batch.layers),
                       passage_ids=list(batch.passage_ids), fallback=fallback)
