"""Passages as the padded batches a forward runs: tokenized once (with character offsets), cut into length
buckets, padded on the tokenizer's side, and handed to the model as tensors with positions that ignore padding."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from poolbench.corpus.passage import Passage
from poolbench.errors import ExtractionError
from poolbench.extractor.batching import (
    plan_batches,
)


@dataclass
class TokenizedPassages:
    """Every passage tokenized once, unpadded; offsets already (0, 0) on special tokens."""

    ids: list[str]
    texts: list[str]
    input_ids: list[list[int]]
    offsets: list[list[tuple[int, int]]]
    special: list[list[bool]]

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


@dataclass
class PaddedBatch:
    """One planned batch as numpy arrays; `indices` point into the passages it was cut from."""

    indices: list[int]
    passage_ids: list[str]
    texts: list[str]
    input_ids: np.ndarray  # [B, T] int64
    attention_mask: np.ndarray  # [B, T] bool
    offsets: np.ndarray  # [B, T, 2] int32
    special_mask: np.ndarray  # [B, T] bool, never True on padding

    def select(self, rows: slice) -> PaddedBatch:
        """A chunk of this batch's rows at the same padded length, so every row sees exactly the same forward."""
        return PaddedBatch(self.indices[rows], self.passage_ids[rows], self.texts[rows], self.input_ids[rows],
                           self.attention_mask[rows], self.offsets[rows], self.special_mask[rows])

    @property
    def left_padded(self) -> bool:
        """True when some row has padding before its first real token."""
        mask = self.attention_mask
        return bool((~mask[:, 0] & mask.any(axis=1)).any())


def tokenize_passages(
    tokenizer, texts: Sequence[str], ids: Sequence[str], max_length: int
) -> TokenizedPassages:
    """Tokenize all texts in one call with character offsets (needs a fast tokenizer), cut at max_length."""
    if not getattr(tokenizer, "is_fast", False):
        raise ExtractionError(f"tokenizer {type(tokenizer).__name__} is not fast; character offsets need one")
    if len(texts) != len(ids):
        raise ExtractionError(f"{len(texts)} texts but {len(ids)} passage ids")
    encoded = tokenizer(
        list(texts),
        truncation=True,
        max_length=max_length,
        padding=False,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_attention_mask=False,
    )
    special = [[bool(flag) for flag in row] for row in encoded["special_tokens_mask"]]
    offsets = [
        [(0, 0) if flag else (int(start), int(end)) for (start, end), flag in zip(row, flags, strict=True)]
        for row, flags in zip(encoded["offset_mapping"], special, strict=True)
    ]
    input_ids = [list(row) for row in encoded["input_ids"]]
    return TokenizedPassages(list(ids), list(texts), input_ids, offsets, special)


def pad_batch(tokens: TokenizedPassages, indices: Sequence[int], pad_id: int, side: str) -> PaddedBatch:
    """Pad the chosen passages to the batch's longest, on `side` ("left" or "right")."""
    if side not in ("left", "right"):
        raise ExtractionError(f"tokenizer padding_side {side!r}; expected 'left' or 'right'")
    length = max((len(tokens.input_ids[i]) for i in indices), default=0)
    batch = len(indices)
    input_ids = np.full((batch, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch, length), dtype=bool)
    offsets = np.zeros((batch, length, 2), dtype=np.int32)
    special_mask = np.zeros((batch, length), dtype=bool)
    for row, index in enumerate(indices):
        n = len(tokens.input_ids[index])
        span = slice(length - n, length) if side == "left" else slice(0, n)
        input_ids[row, span] = tokens.input_ids[index]
        attention_mask[row, span] = True
        if n:
            offsets[row, span] = tokens.offsets[index]
            special_mask[row, span] = tokens.special[index]
    return PaddedBatch(
        list(indices),
        [tokens.ids[i] for i in indices],
        [tokens.texts[i] for i in indices],
        input_ids,
        attention_mask,
        offsets,
        special_mask,
    )


def _texts_and_ids(
    passages: Sequence[Passage] | Sequence[str], ids: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    if all(isinstance(p, Passage) for p in passages):
        if ids is not None:
            raise ExtractionError("give ids only with plain texts; Passage objects carry their own")
        return [p.text for p in passages], [p.id for p in passages]  # type: ignore[union-attr]
    texts = [str(p) for p in passages]
    return texts, [str(i) for i in ids] if ids is not None else [str(i) for i in range(len(texts))]


def prepare_batches(
    tokenizer,
    passages: Sequence[Passage] | Sequence[str],
    *,
    ids: Sequence[str] | None = None,
    batch_size: int = 32,
    max_tokens: int | None = None,
    max_length: int = 256,
) -> list[PaddedBatch]:
    """Tokenize once and pad every length bucket, on the tokenizer's padding side, ready for the forward."""
    texts, passage_ids = _texts_and_ids(passages, ids)
    return pad_batches(tokenizer, tokenize_passages(tokenizer, texts, passage_ids, max_length),
                       batch_size=batch_size, max_tokens=max_tokens)


def pad_batches(tokenizer, tokens: TokenizedPassages, *, batch_size: int = 32,
                max_tokens: int | None = None) -> list[PaddedBatch]:
    """Every length bucket of already tokenized passages, padded on the tokenizer's padding side."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # any id works under a zero attention mask
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    side = getattr(tokenizer, "padding_side", "right")
    return [
        pad_batch(tokens, indices, pad_id, side)
        for indices in plan_batches(tokens.lengths, batch_size, max_tokens)
    ]


def model_inputs(model: nn.Module, batch: PaddedBatch) -> dict[str, torch.Tensor | bool]:
    """Tensors on the model's device. Left-padded batches get positions counted from each row's first real
    token, as generate() does, so real tokens sit where they would unpadded (transformers 5 forwards
    default to arange(T) whatever the mask). Offset-position models (RoBERTa) need right padding, their
    tokenizers' default."""
    device = next(model.parameters()).device
    accepted = inspect.signature(model.forward).parameters
    mask = host_to_device(batch.attention_mask, device).to(torch.long)
    inputs: dict[str, torch.Tensor | bool] = {
        "input_ids": host_to_device(batch.input_ids, device),
        "attention_mask": mask,
        "output_hidden_states": False,
    }
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    if batch.left_padded and "position_ids" in accepted:
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return inputs


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An input array on the device. To CUDA through page-locked memory, non-blocking: a copy from pageable
    memory waits for everything already enqueued on the stream, so a chunk's inputs would wait for the chunk
    before it to end (the capture enqueues the next chunk before it finishes the last: capture.capture_chunks)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
