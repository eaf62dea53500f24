"""The exact log-likelihood shift of many steering deltas at one layer, replayed from that layer.

Adding delta at `layers.{L}.out` leaves blocks 0..L untouched, so for every delta and alpha the prefix of the
forward is the same: one unsteered forward per padded batch gives each passage's unsteered log p (the cached
baseline) and the layer's hidden state; each delta then runs only blocks L+1.. and the head, all deltas of a
chunk stacked as one batch dimension over the same passages. Blocks 0..L are swapped, for the replay only, for
stand-ins that hand on the stored hidden state plus the delta, so the model's own forward still builds its masks,
positions, final norm and head (any architecture `find_decoder_layers` finds). Not thread-safe: the model's
blocks are swapped while a replay runs (the validation runs in one thread).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from poolbench.extractor.loading import LoadedModel
from poolbench.extractor.padded_batches import model_inputs, pad_batches, tokenize_passages

from .errors import SteeringError
from .likelihood_shift import row_log_likelihoods


class _Handoff(nn.Module):
    """A stand-in for block i <= L: blocks below L pass their input on; block L returns the stored state."""

    def __init__(self, stored: torch.Tensor | None, as_tuple: bool) -> None:
        super().__init__()
        self.stored, self.as_tuple = stored, as_tuple

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> object:
        out = hidden_states if self.stored is None else self.stored
        return (out,) if self.as_tuple else out


@contextmanager
def _replaying(blocks: nn.ModuleList, layer: int, stored: torch.Tensor, as_tuple: bool) -> Iterator[None]:
    originals = [blocks[i] for i in range(layer + 1)]
    try:
        for i in range(layer):
            blocks[i] = _Handoff(None, as_tuple)
        blocks[layer] = _Handoff(stored, as_tuple)
        yield
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block


def _capture(loaded: LoadedModel, inputs: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The unsteered logits and `layers.{layer}.out` of one batch, and whether the block returns a tuple."""
    seen: dict[str, object] = {}

    def hook(_module: nn.Module, _args: object, output: object) -> None:
        seen["out"] = output

    handle = loaded.decoder_layers[layer].register_forward_hook(hook)
    try:
        logits = loaded.model(**inputs).logits
    finally:
        handle.remove()
    output = seen["out"]
    hidden = output[0] if isinstance(output, tuple) else output
    if not isinstance(hidden, torch.Tensor):
        raise SteeringError(f"block {layer} returned {type(output).__name__}; expected a tensor or tuple led by one")
    return logits, hidden.detach().clone(), isinstance(output, tuple)


@torch.inference_mode()
def replayed_shifts(loaded: LoadedModel, texts: Sequence[str], layer: int, deltas: np.ndarray, *,
                    batch_size: int = 16, max_length: int = 256, max_tokens: int = 4096,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(base [N], steered [K, N]): each text's unsteered log p and its log p with deltas[k] added at every
    position of `layers.{layer}.out`, tokenised as passage_log_likelihoods tokenises; `max_tokens` bounds the
    padded tokens of one replay (deltas x passages x length), which bounds its logits' memory."""
    D = np.asarray(deltas, dtype=np.float32)
    if D.ndim != 2 or D.shape[1] != loaded.hidden_size:
        raise SteeringError(f"deltas of shape {D.shape}; expected [K, {loaded.hidden_size}]")
    if not 0 <= layer < loaded.n_layers:
        raise SteeringError(f"layer {layer}: the model has layers 0..{loaded.n_layers - 1}")
    tokens = tokenize_passages(loaded.tokenizer, list(texts), [str(i) for i in range(len(texts))], max_length)
    base = np.zeros(len(texts), dtype=np.float64)
    steered = np.zeros((len(D), len(texts)), dtype=np.float64)
    added = torch.as_tensor(D, device=loaded.device)
    for batch in pad_batches(loaded.tokenizer, tokens, batch_size=batch_size):
        inputs = model_inputs(loaded.model, batch)
        ids = inputs["input_ids"]
        mask = inputs["attention_mask"].to(torch.bool)  # type: ignore[union-attr]
        rows = np.asarray(batch.indices)
        logits, hidden, as_tuple = _capture(loaded, inputs, layer)
        base[rows] = row_log_likelihoods(logits, ids, mask).cpu().numpy()  # type: ignore[arg-type]
        del logits
        n, t = hidden.shape[0], hidden.shape[1]
        chunk = max(1, max_tokens // max(1, n * t))
        for start in range(0, len(D), chunk):
            k = min(chunk, len(D) - start)
            stacked = (hidden.unsqueeze(0) + added[start:start + k, None, None, :].to(hidden.dtype))
            stacked = stacked.reshape(k * n, t, hidden.shape[2])
            repeated = {name: (value.repeat(k, *([1] * (value.dim() - 1)))
                               if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n
                               else value) for name, value in inputs.items()}
            with _replaying(loaded.decoder_layers, layer, stacked, as_tuple):
                out = loaded.model(**repeated).logits
            scores = row_log_likelihoods(out, repeated["input_ids"], mask.repeat(k, 1))  # type: ignore[arg-type]
            steered[start:start + k][:, rows] = scores.reshape(k, n).cpu().numpy()
    return base, steered
