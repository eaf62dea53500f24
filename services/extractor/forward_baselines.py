"""Timing baselines a bench holds the capture against: the plain forward, and S2's forward with one backward,
on the same batches, so a hooked path can never look faster than the model it reads."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from poolbench.extractor.batching import (
    free_memory_bytes,
    gradient_rows_per_forward,
    row_chunks,
)
from poolbench.extractor.capture import model_token_costs, resolve_max_batch_tokens, sync_device
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.lm_head_likelihood import final_hidden, layer_gradients, lm_head, real_pairs_from_host
from poolbench.extractor.padded_batches import PaddedBatch, model_inputs


def forward_only(
    model: nn.Module, batches: Iterable[PaddedBatch], *, stats: ExtractionStats | None = None
) -> ExtractionStats:
    """The timing baseline: the plain decoder forward (full depth, final norm, no LM head, no hooks) on the
    same batches under inference_mode, so a hooked path can never look faster than the model it reads."""
    stats = stats if stats is not None else ExtractionStats()
    decoder = getattr(model, "base_model", model)
    for batch in batches:
        start = time.perf_counter()
        with torch.inference_mode():
            decoder(**model_inputs(decoder, batch))
        sync_device(model)
        stats.count_forward(batch, time.perf_counter() - start)
    return stats


def forward_backward(
    model: nn.Module, batches: Iterable[PaddedBatch], *, max_batch_tokens: int | None = None,
    stats: ExtractionStats | None = None,
) -> ExtractionStats:
    """The S2 baseline: forward to the final hidden state, the LM head in chunks and one backward of the
    log-likelihood to the input embeddings, in the sub-chunks S2 itself would use at this budget and free memory
    (its graph here spans every block)."""
    stats = stats if stats is not None else ExtractionStats()
    layers = (0,)
    budget = resolve_max_batch_tokens(model, layers, max_batch_tokens)
    costs = model_token_costs(model, layers, frozenset({"gradient"}))  # n_layers - 0 blocks: every block
    free = free_memory_bytes(next(model.parameters()).device)
    lm_head(model)
    embed = model.get_input_embeddings()
    for batch in batches:
        rows = gradient_rows_per_forward(costs, budget, batch.input_ids.shape[1], free)
        for chunk in row_chunks(len(batch.indices), rows):
            part = batch.select(chunk)
            start = time.perf_counter()
            with torch.enable_grad():
                inputs = model_inputs(model, part)
                ids = inputs.pop("input_ids")
                embeds = embed(ids).detach().requires_grad_(True)  # type: ignore[arg-type]
                final = final_hidden(model, {"inputs_embeds": embeds, **inputs})
                layer_gradients(model, final, [embeds], ids, inputs["attention_mask"].to(torch.bool),  # type: ignore
                                pairs=real_pairs_from_host(part.attention_mask, ids.device))  # as the capture
            sync_device(model)
            stats.count_forward(part, time.perf_counter() - start)
    return stats
