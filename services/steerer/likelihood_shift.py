"""The exact twin of first-order steerability: each passage's log-likelihood with a steering delta added at every
position of one layer's output (as both backends add it), tokenised exactly as the extraction that took the
gradients tokenised it, so the two measures differ only by the terms beyond first order."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from poolbench.extractor.hook_points import add_hooks
from poolbench.extractor.loading import LoadedModel
from poolbench.extractor.padded_batches import model_inputs, pad_batches, tokenize_passages


def row_log_likelihoods(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] each row's sum of log p(x_{t+1} | x_<=t) over pairs of real tokens (S2's score, per row)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (picked * (mask[:, :-1] & mask[:, 1:])).sum(dim=1)


@torch.no_grad()
def passage_log_likelihoods(loaded: LoadedModel, texts: Sequence[str], *, layer: int | None = None,
                            delta: np.ndarray | None = None, batch_size: int = 16,
                            max_length: int = 256) -> np.ndarray:
    """[N] log p(text) under the model, with `delta` added at `layers.{layer}.out` when given."""
    tokens = tokenize_passages(loaded.tokenizer, list(texts), [str(i) for i in range(len(texts))], max_length)
    out = np.zeros(len(texts), dtype=np.float64)
    hooks = {}
    if delta is not None:
        if layer is None:
            raise ValueError("a steering delta needs its layer")
        added = torch.as_tensor(np.asarray(delta, dtype=np.float32), device=loaded.device)
        hooks = {f"layers.{int(layer)}.out": lambda hidden: hidden + added.to(hidden.dtype)}
    with add_hooks(loaded.decoder_layers, hooks):
        for batch in pad_batches(loaded.tokenizer, tokens, batch_size=batch_size):
            inputs = model_inputs(loaded.model, batch)
            logits = loaded.model(**inputs).logits
            mask = inputs["attention_mask"].to(torch.bool)  # type: ignore[union-attr]
            scores = row_log_likelihoods(logits, inputs["input_ids"], mask)  # type: ignore[arg-type]
            out[np.asarray(batch.indices)] = scores.cpu().numpy()
    return out
