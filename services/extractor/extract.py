"""Extraction core: tokenize once, bucket by length, one hooked forward per batch, ActivationBatch out."""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from poolbench.corpus.passage import Passage
from poolbench.errors import PoolBenchError

from .activations import ActivationBatch
from .attention_capture import (
    capture_attention,
    gradient_layer_outputs,
    passage_log_likelihood,
)
from .batching import plan_batches
from .hook_points import capture_layer_outputs


class ExtractionError(PoolBenchError):
    """A tokenizer or model that extraction cannot work with."""


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

    @property
    def left_padded(self) -> bool:
        """True when some row has padding before its first real token."""
        mask = self.attention_mask
        return bool((~mask[:, 0] & mask.any(axis=1)).any())


@dataclass
class ExtractionStats:
    """Counters a bench reads: real tokens vs padded tokens, and where the time went."""

    batches: int = 0
    passages: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    forward_seconds: float = 0.0
    convert_seconds: float = 0.0


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
    tokens = tokenize_passages(tokenizer, texts, passage_ids, max_length)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # any id works under a zero attention mask
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    side = getattr(tokenizer, "padding_side", "right")
    return [
        pad_batch(tokens, indices, pad_id, side)
        for indices in plan_batches(tokens.lengths, batch_size, max_tokens)
    ]


def _model_inputs(model: nn.Module, batch: PaddedBatch) -> dict[str, torch.Tensor | bool]:
    """Tensors on the model's device. Left-padded batches get positions counted from each row's first real
    token, as generate() does, so real tokens sit where they would unpadded (transformers 5 forwards
    default to arange(T) whatever the mask). Offset-position models (RoBERTa) need right padding, their
    tokenizers' default."""
    device = next(model.parameters()).device
    accepted = inspect.signature(model.forward).parameters
    mask = torch.from_numpy(batch.attention_mask).to(device=device, dtype=torch.long)
    inputs: dict[str, torch.Tensor | bool] = {
        "input_ids": torch.from_numpy(batch.input_ids).to(device),
        "attention_mask": mask,
        "output_hidden_states": False,
    }
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    if batch.left_padded and "position_ids" in accepted:
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return inputs


def _sync(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_dtype(dtype_out: np.dtype | type) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype_out)).dtype


def extract_batches(
    model: nn.Module,
    decoder_layers: Sequence[nn.Module],
    batches: Iterable[PaddedBatch],
    layers: Sequence[int],
    *,
    dtype_out: np.dtype | type = np.float32,
    stats: ExtractionStats | None = None,
    stop_early: bool = True,
    needs: Collection[str] = frozenset(),
) -> Iterator[ActivationBatch]:
    """One forward per prepared batch, capturing every requested layer; stops after the deepest one.

    `needs` (the union of the pooled strategies' needs) adds extras computed in that same forward and only
    then: "attention" -> attention_inflow / attention_inflow_last [L,B,T] and their per-head forms
    attention_head_inflow / attention_head_inflow_last [L,B,H,T]; with "labels" also
    attention_head_output_last [L,B,H,Dh]; "gradient" -> gradient_norm / gradient_x_input [L,B,T] (the forward
    then runs to the LM head with grad enabled and one backward serves all layers).
    """
    layers = tuple(int(layer) for layer in layers)
    out_dtype = _torch_dtype(dtype_out)
    needs = frozenset(needs)
    attention, gradient = "attention" in needs, "gradient" in needs
    for batch in batches:
        start = time.perf_counter()
        extras: dict[str, np.ndarray] = {}
        grad_mode = torch.enable_grad() if gradient else torch.inference_mode()
        with grad_mode, ExitStack() as stack:
            inputs = _model_inputs(model, batch)
            mask = inputs["attention_mask"].to(torch.bool)  # type: ignore[union-attr]
            heads = stack.enter_context(
                capture_attention(model, decoder_layers, layers, mask, head_outputs="labels" in needs)
                if attention else nullcontext({}))
            if gradient:
                with gradient_layer_outputs(decoder_layers, layers) as captured:
                    output = model(**inputs)
                logits = getattr(output, "logits", None)
                if logits is None:
                    raise ExtractionError(f"{type(model).__name__} has no LM head: gradient saliency (S2) "
                                          "needs a causal LM's log-likelihood")
                score = passage_log_likelihood(logits, inputs["input_ids"], mask)  # type: ignore[arg-type]
                tensors = [captured[layer] for layer in layers]
                grads = torch.autograd.grad(score, tensors)
                with torch.no_grad():
                    extras["gradient_norm"] = torch.stack(
                        [torch.linalg.vector_norm(g.float(), dim=-1) for g in grads]).cpu().numpy()
                    extras["gradient_x_input"] = torch.stack(
                        [(g.float() * h.float()).sum(-1).abs() for g, h in zip(grads, tensors, strict=True)]
                    ).cpu().numpy()
                captured = {layer: h.detach() for layer, h in captured.items()}
            else:
                with capture_layer_outputs(decoder_layers, layers, stop_early=stop_early) as captured:
                    model(**inputs)
            missing = [layer for layer in layers if layer not in captured]
            if missing:
                raise ExtractionError(f"layers {missing} never ran: decoder_layers are not this model's")
        if attention:
            _attention_extras(heads, layers, extras)
        _sync(model)
        converted = time.perf_counter()
        with torch.inference_mode():
            hidden = torch.stack([captured[layer] for layer in layers]).to(out_dtype).cpu().numpy()
        done = time.perf_counter()
        if stats is not None:
            stats.batches += 1
            stats.passages += len(batch.indices)
            stats.tokens += int(batch.attention_mask.sum())
            stats.padded_tokens += batch.attention_mask.size
            stats.forward_seconds += converted - start
            stats.convert_seconds += done - converted
        yield ActivationBatch(
            passage_ids=batch.passage_ids,
            texts=batch.texts,
            layers=layers,
            hidden=hidden,
            attention_mask=batch.attention_mask,
            input_ids=batch.input_ids,
            offsets=batch.offsets,
            special_mask=batch.special_mask,
            extras=extras,
        )


def _attention_extras(heads: dict[int, dict[str, torch.Tensor]], layers: Sequence[int],
                      extras: dict[str, np.ndarray]) -> None:
    """Stack the per-layer head arrays to [L, ...] numpy extras, plus the head means S1 pools with."""
    for name in ("inflow", "inflow_last", "head_output_last"):
        if name in heads[layers[0]]:
            key = f"attention_head_{name}" if name != "head_output_last" else "attention_head_output_last"
            extras[key] = torch.stack([heads[layer][name] for layer in layers]).cpu().numpy()
    extras["attention_inflow"] = extras["attention_head_inflow"].mean(axis=2)
    extras["attention_inflow_last"] = extras["attention_head_inflow_last"].mean(axis=2)


def forward_only(
    model: nn.Module, batches: Iterable[PaddedBatch], *, stats: ExtractionStats | None = None
) -> ExtractionStats:
    """The model's plain forward on the same batches, no hooks, full depth: the baseline for timing."""
    stats = stats if stats is not None else ExtractionStats()
    for batch in batches:
        start = time.perf_counter()
        with torch.inference_mode():
            model(**_model_inputs(model, batch))
        _sync(model)
        stats.batches += 1
        stats.passages += len(batch.indices)
        stats.tokens += int(batch.attention_mask.sum())
        stats.padded_tokens += batch.attention_mask.size
        stats.forward_seconds += time.perf_counter() - start
    return stats


def extract_activations(
    model: nn.Module,
    tokenizer,
    decoder_layers: Sequence[nn.Module],
    passages: Sequence[Passage] | Sequence[str],
    layers: Sequence[int],
    *,
    ids: Sequence[str] | None = None,
    batch_size: int = 32,
    max_tokens: int | None = None,
    max_length: int = 256,
    dtype_out: np.dtype | type = np.float32,
    stats: ExtractionStats | None = None,
    needs: Collection[str] = frozenset(),
) -> Iterator[ActivationBatch]:
    """Hidden states at "layers.{L}.out" of every passage, one ActivationBatch per length bucket, in order.

    Tokenizing and planning happen at the call, so a bad tokenizer fails here rather than at the first batch.
    """
    batches = prepare_batches(
        tokenizer, passages, ids=ids, batch_size=batch_size, max_tokens=max_tokens, max_length=max_length
    )
    return extract_batches(model, decoder_layers, batches, layers, dtype_out=dtype_out, stats=stats,
                           needs=needs)
