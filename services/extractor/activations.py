"""ActivationBatch: the transient hand-off from extractor to pooler (memory or Ray object store, never disk)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def hook_point_name(layer: int) -> str:
    """The TransformerLens-style name of a decoder layer's output (the residual stream after layer L)."""
    return f"layers.{layer}.out"


@dataclass
class ActivationBatch:
    """Hidden states of one padded batch for every requested layer, plus what pooling needs to align tokens.

    Arrays are numpy so they cross Ray's object store zero-copy; `torch.from_numpy` shares their memory.
    Shapes: L = len(layers), B = len(passage_ids), T = padded length, d = hidden size.
    """

    passage_ids: list[str]
    texts: list[str]
    layers: tuple[int, ...]
    hidden: np.ndarray  # [L, B, T, d] float32 (or float16/bfloat16-as-float32 when the model runs in half)
    attention_mask: np.ndarray  # [B, T] bool, True on real tokens (padding may be on either side)
    input_ids: np.ndarray  # [B, T] int64
    offsets: np.ndarray  # [B, T, 2] int32 character spans into texts[b]; (0, 0) for special and pad tokens
    special_mask: np.ndarray  # [B, T] bool, True on special tokens (BOS/EOS/CLS/SEP) that are not padding
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # per-need arrays, e.g. "attention_inflow" [L,B,T]

    def __post_init__(self) -> None:
        n_layers, batch, length, _ = self.hidden.shape
        if n_layers != len(self.layers) or batch != len(self.passage_ids):
            raise ValueError(
                f"ActivationBatch: hidden has shape {self.hidden.shape} but layers={self.layers} "
                f"and {len(self.passage_ids)} passages"
            )
        for name in ("attention_mask", "input_ids", "special_mask"):
            if getattr(self, name).shape != (batch, length):
                raise ValueError(f"ActivationBatch: {name} has shape {getattr(self, name).shape}, "
                                 f"expected {(batch, length)}")
        if self.offsets.shape != (batch, length, 2):
            raise ValueError(f"ActivationBatch: offsets has shape {self.offsets.shape}, "
                             f"expected {(batch, length, 2)}")

    @property
    def lengths(self) -> np.ndarray:
        """Number of real (non-pad) tokens per passage."""
        return self.attention_mask.sum(axis=1)

    @property
    def hook_points(self) -> list[str]:
        return [hook_point_name(layer) for layer in self.layers]
