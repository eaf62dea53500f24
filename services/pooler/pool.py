"""pool_tokens: every strategy and layer of a batch in one weight tensor and one batched contraction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.sink import attention_sink_rows, drop_first, sink_rows
from poolbench.pooler.spec import HiddenOnDevice, StrategySpec, TokenContext


@dataclass
class PooledBatch:
    """Pooled vectors of one batch; `fallback[s, b]` marks a weights strategy that selected no token for
    passage b (at any layer, for layer-dependent weights) and so fell back there to the plain mean (A1)."""

    vectors: np.ndarray  # [L, S, B, d] float32
    strategy_ids: list[str]
    layers: tuple[int, ...]
    passage_ids: list[str]
    fallback: np.ndarray  # [S, B] bool


def pool_tokens(batch: ActivationBatch, specs: Sequence[StrategySpec]) -> PooledBatch:
    """Pool with all strategies at once. Every weights spec goes into one weight tensor and one matmul
    against the hidden states (a view, never copied); max/min reduce over each passage's real-token slice."""
    specs = list(specs)
    hidden_np = _checked_hidden(batch, specs)
    n_layers, batch_size, _, dim = hidden_np.shape
    hidden = torch.from_numpy(hidden_np)
    mask = np.asarray(batch.attention_mask, dtype=bool)
    ctx = TokenContext.from_batch(batch)

    out = torch.empty((n_layers, len(specs), batch_size, dim), dtype=torch.float32)
    fallback = np.zeros((len(specs), batch_size), dtype=bool)
    weighted: list[tuple[int, np.ndarray]] = []
    reductions: list[tuple[int, str]] = []
    for s, spec in enumerate(specs):
        if spec.kind == "reduction":
            reductions.append((s, spec.reduction, sink_rows(ctx.token_norms, mask, spec.sink_mode)))
        else:
            weighted.append((s, token_weights(spec, ctx, n_layers)))

    if weighted:
        index = [s for s, _ in weighted]
        by_count = np.array([specs[s].divide_by == "token_count" for s in index])
        if all(w.ndim == 2 for _, w in weighted):
            weights = np.stack([w for _, w in weighted])  # [S, B, T], shared by every layer
            fallback[index] = normalise_weights(weights, mask, by_count)
            w = torch.from_numpy(weights).transpose(0, 1)  # [B, S, T], broadcast over L by matmul
        else:  # some weights differ per layer: give every spec a layer axis and still contract once
            weights = np.empty((n_layers, len(weighted), *mask.shape), dtype=np.float32)  # [L, S, B, T]
            for i, (_, w) in enumerate(weighted):
                weights[:, i] = w
            fallback[index] = normalise_weights(weights, mask, by_count).any(axis=0)
            w = torch.from_numpy(weights).transpose(1, 2)  # [L, B, S, T]
        _put(out, index, torch.matmul(w, hidden).transpose(1, 2))  # [L,B,S,d] -> [L,S,B,d]
    if reductions:
        _reduce(out, hidden, mask, reductions)

    return PooledBatch(vectors=out.numpy(), strategy_ids=[spec.id for spec in specs],
                       layers=tuple(batch.layers), passage_ids=list(batch.passage_ids), fallback=fallback)


def token_weights(spec: StrategySpec, ctx: TokenContext, n_layers: int) -> np.ndarray:
    """A spec's weights as float32 [B,T] or [L,B,T], zero on padding, checked for shape and sign."""
    weights = checked_weights(spec, ctx, n_layers)
    if spec.sink_mode == "keep":
        return weights
    rows = sink_rows(ctx.token_norms, ctx.attention_mask, spec.sink_mode)
    if spec.sink_mode == "auto" and spec.attention_queries is not None:
        rows = rows | attention_sink_rows(weights, ctx.attention_mask, spec.attention_queries)
    return drop_first(weights, ctx.attention_mask, rows)


def checked_weights(spec: StrategySpec, ctx: TokenContext, n_layers: int) -> np.ndarray:
    """weights_fn's output before the sink rule: float32, zero on padding, shape and sign checked."""
    batch_size, length = ctx.attention_mask.shape
    try:
        raw = np.asarray(spec.weights_fn(ctx))
    except StrategyError as exc:
        if repr(spec.id) in str(exc):
            raise
        raise StrategyError(f"strategy {spec.id!r}: {exc}") from exc
    except HiddenOnDevice:
        raise
    except Exception as exc:
        raise StrategyError(f"strategy {spec.id!r}: weights_fn failed: {type(exc).__name__}: {exc}") from exc
    if raw.shape not in ((batch_size, length), (n_layers, batch_size, length)):
        raise StrategyError(f"strategy {spec.id!r}: weights have shape {raw.shape}, expected "
                            f"{(batch_size, length)} or {(n_layers, batch_size, length)}")
    weights = np.where(ctx.attention_mask, raw, 0).astype(np.float32, copy=False)
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise StrategyError(f"strategy {spec.id!r}: weights must be finite and non-negative")
    return weights


def normalise_weights(weights: np.ndarray, mask: np.ndarray, by_count: np.ndarray | None = None) -> np.ndarray:
    """Scale [..., B, T] weights in place to sum 1 per passage; all-zero rows become A1 mean weights.
    `by_count` ([S] bool over the spec axis, -3) marks specs divided by the real-token count instead
    (divide_by="token_count"): their weights then sum to their total over the count. Returns the [..., B]
    fallback flags."""
    totals = weights.sum(axis=-1)
    empty = totals <= 0
    if by_count is not None and by_count.any():
        count = np.maximum(mask.sum(axis=-1), 1)
        scale = np.where(by_count[:, None] & ~empty, totals / count, 1.0)
    else:
        scale = None
    if empty.any():
        mask_b = np.broadcast_to(mask, weights.shape)
        weights[empty] = mask_b[empty]
        totals[empty] = weights[empty].sum(axis=-1)
    weights /= totals[..., None]
    if scale is not None:
        weights *= scale[..., None]
    return empty


def _checked_hidden(batch: ActivationBatch, specs: list[StrategySpec]) -> np.ndarray:
    check_pool_inputs(batch.passage_ids, batch.lengths, specs)
    return np.asarray(batch.hidden, dtype=np.float32)  # a view when already float32


def check_pool_inputs(passage_ids: Sequence[str], lengths: np.ndarray, specs: Sequence[StrategySpec]) -> None:
    """Strategy ids given once, every passage with a real token: what either pooling path refuses."""
    ids = [spec.id for spec in specs]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise StrategyError(f"pool_tokens: strategy id(s) given twice: {', '.join(repeated)}")
    empty = [pid for pid, n in zip(passage_ids, lengths, strict=True) if n == 0]
    if empty:
        raise StrategyError(f"pool_tokens: passage {empty[0]!r} has no real tokens to pool")


def _put(out: torch.Tensor, index: list[int], values: torch.Tensor) -> None:
    if index == list(range(index[0], index[-1] + 1)):
        out[:, index[0]:index[-1] + 1] = values
    else:
        out[:, index] = values


def _reduce(out: torch.Tensor, hidden: torch.Tensor, mask: np.ndarray,
            reductions: list[tuple[int, str, np.ndarray]]) -> None:
    """Masked max/min. Real tokens form one run per passage (padding on either side), so each passage
    reduces over a slice view; a mask with holes goes through one reused ±inf-filled [B,T,d] buffer.
    Each reduction's [L,B] sink rows start that passage's run one token later at that layer."""
    lengths = mask.sum(axis=1)
    first = mask.argmax(axis=1)
    last = mask.shape[1] - 1 - mask[:, ::-1].argmax(axis=1)
    if (last - first + 1 == lengths).all():
        for b, (start, stop) in enumerate(zip(first, last + 1, strict=True)):
            tokens = hidden[:, b, start:stop]  # [L, n, d]
            for s, reduction, sink in reductions:
                out[:, s, b] = tokens.amax(dim=1) if reduction == "max" else tokens.amin(dim=1)
                for layer in np.flatnonzero(sink[:, b]):
                    rest = tokens[layer, 1:]
                    out[layer, s, b] = rest.amax(dim=0) if reduction == "max" else rest.amin(dim=0)
        return
    buffer = torch.empty(hidden.shape[1:], dtype=hidden.dtype)
    for layer in range(hidden.shape[0]):
        for s, reduction, sink in reductions:
            kept = mask.copy()
            kept[np.flatnonzero(sink[layer]), first[sink[layer]]] = False
            keep = torch.from_numpy(kept)[:, :, None]
            fill = torch.tensor(float("-inf") if reduction == "max" else float("inf"), dtype=hidden.dtype)
            torch.where(keep, hidden[layer], fill, out=buffer)
            reduce = torch.amax if reduction == "max" else torch.amin
            reduce(buffer, dim=1, out=out[layer, s])
