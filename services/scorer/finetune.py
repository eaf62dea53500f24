"""Fine-tune a pretrained encoder into a binary concept classifier on CPU in seconds.

What is trained: the top `train_top_layers` transformer blocks and a fresh linear head on the mean-pooled
token states (the pooling all-MiniLM-L6-v2 was trained with); the embeddings and lower blocks stay frozen.
Because they are frozen, their output for each training text is computed once, and every epoch runs only
the trained blocks on it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from transformers import AutoModel, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from poolbench.extractor.loading import find_decoder_layers

from .errors import ScorerError


class ScorerConfig(BaseModel):
    """Everything besides the encoder weights and the texts that determines a scorer; part of its key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    encoder: str = "all-MiniLM-L6-v2"
    train_top_layers: int = Field(1, ge=1)
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-4, gt=0)
    head_lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    dropout: float = Field(0.1, ge=0, lt=1)
    max_length: int = Field(64, ge=8)
    seed: int = 0
    min_auroc: float = Field(0.7, ge=0, le=1)


class MeanPoolClassifier(nn.Module):
    """Encoder -> mean over real tokens -> linear logit: P(concept) = sigmoid(logit)."""

    def __init__(self, encoder: PreTrainedModel, dropout: float = 0.0) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(int(encoder.config.hidden_size), 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **extra: torch.Tensor
                ) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        return self.pooled_logit(hidden, attention_mask)

    def pooled_logit(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The logit from the encoder's last states [B, T, d] (shared_trunk.py calls it on states it ran)."""
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return self.head(self.dropout(pooled)).squeeze(-1)


@dataclass
class FineTuned:
    model: MeanPoolClassifier
    tokenizer: object
    train_seconds: float
    trained: str  # which parameters were fine-tuned, in words
    trained_params: int
    total_params: int


def _parent_and_name(root: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for _name, module in root.named_modules():
        for attr, sub in module.named_children():
            if sub is child:
                return module, attr
    raise ScorerError(f"encoder {type(root).__name__}: its block list has no parent module")


@contextmanager
def _run_from_block(model: PreTrainedModel, layers: nn.ModuleList, start: int,
                    cached: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside, a forward skips the embeddings and blocks < start: the embeddings' output is replaced by
    cached["hidden"], the precomputed input of block `start`, and only blocks >= start run."""
    embeddings = getattr(model.base_model, "embeddings", None)
    if embeddings is None:
        raise ScorerError(f"encoder {type(model).__name__} has no .embeddings module to start after")
    parent, attr = _parent_and_name(model, layers)
    handle = embeddings.register_forward_hook(lambda _m, _a, _o: cached["hidden"])
    setattr(parent, attr, nn.ModuleList(list(layers)[start:]))
    try:
        yield
    finally:
        setattr(parent, attr, layers)
        handle.remove()


def load_encoder(source: str, name: str) -> tuple[object, PreTrainedModel]:
    """Tokenizer and bare encoder (no pooler: the head reads mean-pooled tokens), without load chatter."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        try:
            encoder = AutoModel.from_pretrained(source, dtype=torch.float32, add_pooling_layer=False)
        except TypeError:
            encoder = AutoModel.from_pretrained(source, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ScorerError(f"scorer encoder '{name}' could not be loaded: {str(exc).splitlines()[0]}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    return tokenizer, encoder


def _tokenize(tokenizer, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
    return tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def fine_tune(source: str, texts: Sequence[str], labels: Sequence[int], config: ScorerConfig) -> FineTuned:
    """Train top blocks + head on (texts, labels) with a fixed schedule (no early stopping: the held-out
    split is only ever scored, never used to pick a checkpoint)."""
    labels_arr = np.asarray(labels, dtype=np.int64)
    if len(texts) != len(labels_arr) or len(texts) < 4 or set(np.unique(labels_arr)) != {0, 1}:
        raise ScorerError(f"scorer training needs >= 4 texts of both labels, got {len(texts)} "
                          f"with labels {sorted(set(labels_arr.tolist()))}")
    torch.manual_seed(config.seed)
    tokenizer, encoder = load_encoder(source, config.encoder)
    model = MeanPoolClassifier(encoder, config.dropout)
    n_layers = int(encoder.config.num_hidden_layers)
    k = min(config.train_top_layers, n_layers)
    start = n_layers - k
    layers = find_decoder_layers(encoder, n_layers)
    model.requires_grad_(False)
    block_params = [p for block in list(layers)[start:] for p in block.parameters()]
    head_params = list(model.head.parameters())
    for p in block_params + head_params:
        p.requires_grad_(True)

    started = time.perf_counter()
    # Sort by length so each batch pads little; the order is shuffled per epoch below at the batch level.
    order = np.argsort([len(t) for t in texts], kind="stable")
    batches = [order[i:i + config.batch_size] for i in range(0, len(order), config.batch_size)]
    encoded, hidden = [], []
    model.eval()
    with torch.no_grad():
        for idx in batches:
            enc = _tokenize(tokenizer, [texts[i] for i in idx], config.max_length)
            out = encoder(**enc, output_hidden_states=True)
            encoded.append(enc)
            hidden.append(out.hidden_states[start].detach())
    optimizer = torch.optim.AdamW([{"params": block_params, "lr": config.lr},
                                   {"params": head_params, "lr": config.head_lr}],
                                  weight_decay=config.weight_decay)
    total_steps = config.epochs * len(batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / max(total_steps, 1))
    rng = np.random.default_rng(config.seed)
    cached: dict[str, torch.Tensor] = {}
    model.train()
    loss_fn = nn.BCEWithLogitsLoss()
    with _run_from_block(encoder, layers, start, cached):
        for _ in range(config.epochs):
            for b in rng.permutation(len(batches)):
                cached["hidden"] = hidden[b]
                target = torch.as_tensor(labels_arr[batches[b]], dtype=torch.float32)
                loss = loss_fn(model(**encoded[b]), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
    model.eval()
    model.requires_grad_(False)
    trained = (f"top {k} of {n_layers} transformer blocks + a linear head on mean-pooled tokens; "
               "embeddings and lower blocks frozen")
    n_trained = sum(p.numel() for p in block_params + head_params)
    return FineTuned(model, tokenizer, time.perf_counter() - started, trained, n_trained,
                     sum(p.numel() for p in model.parameters()))
