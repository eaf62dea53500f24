"""What the extractor reads from a model's config: its text stack's part of a multimodal config, its heads.

One place for it, so the batch budget (capture), the LM head (lm_head_likelihood) and the store's room (the
worker's count of S3's per-head bytes) read the same fields the same way.
"""

from __future__ import annotations

from torch import nn


def text_config(model: nn.Module):
    """The config of the model's text stack (a multimodal config's text part), or None."""
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def attention_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, head dim) of the model's attention, from its config."""
    text = text_config(model)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    return heads, int(getattr(text, "head_dim", 0) or int(getattr(text, "hidden_size", 0) or 0) // heads)
