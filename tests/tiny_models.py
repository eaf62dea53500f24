"""Tiny HF-format models for tests: the embedded recipe at toy size, saved and loaded like any model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from poolbench.corpus.english import generated_texts
from poolbench.extractor import embedded_model


def save_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = 320) -> Path:
    """A random-weight Llama with a byte-level BPE tokenizer trained on generated text (seconds on CPU)."""
    tokenizer = embedded_model.train_tokenizer(generated_texts(200, seed=3), vocab_size=vocab)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=2 * hidden,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
