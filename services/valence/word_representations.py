"""h(w): a model's representation of each word, read at one layer and pooled over the word's own tokens.

Each word is placed in a template (default "{word}", the word alone after the tokenizer's BOS) and run through
the model. Layer "final" (the default) is the state the LM head reads: layers.{n-1}.out passed through the
model's final norm; an integer L is the raw residual stream layers.L.out. Pooling "word_mean" (the default)
averages the tokens whose character spans overlap the word, so multi-token words work; any registered pooling
strategy id (A1_mean, P1_last, ...) instead pools the whole templated text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from poolbench.corpus.word_lists import WordList, WordListError
from poolbench.extractor.extract import extract_activations
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.alignment import marked_token_mask

FINAL = "final"
WORD_MEAN = "word_mean"
_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


def final_norm(loaded: LoadedModel) -> torch.nn.Module:
    """The norm between the last decoder block and the LM head (Llama's model.norm, GPT-2's ln_f, ...)."""
    base = loaded.model.base_model
    for name in _NORM_NAMES:
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise WordListError(f"model '{loaded.model_id}': no final norm found; pass an integer --layer instead")


def resolve_layer(loaded: LoadedModel, layer: int | str | None) -> tuple[int, bool]:
    """(decoder layer index, apply final norm) for 'final'/None or an integer (negative: from the end)."""
    if layer is None or layer == FINAL:
        return loaded.n_layers - 1, True
    index = int(layer)
    index = index + loaded.n_layers if index < 0 else index
    if not 0 <= index < loaded.n_layers:
        raise WordListError(f"--layer {layer}: the model has {loaded.n_layers} layers "
                            f"(0..{loaded.n_layers - 1})")
    return index, False


def word_representations(loaded: LoadedModel, words: WordList, *, layer: int | str | None = FINAL,
                         pooling: str = WORD_MEAN, template: str = "{word}",
                         batch_size: int = 64) -> np.ndarray:
    """[W, d] float64 representations; a word with no tokens or with unknown tokens is a one-line error."""
    if template.count("{word}") != 1:
        raise WordListError(f"template {template!r} must contain '{{word}}' exactly once")
    index, use_norm = resolve_layer(loaded, layer)
    prefix = template.split("{word}")[0]
    texts = [template.replace("{word}", w) for w in words.words]
    spans = [(len(prefix), len(prefix) + len(w)) for w in words.words]
    specs = None
    if pooling != WORD_MEAN:
        from poolbench.pooler.registry import resolve_strategies

        specs = resolve_strategies([pooling])
    norm = final_norm(loaded) if use_norm else None
    unk = loaded.tokenizer.unk_token_id
    out = np.zeros((len(texts), loaded.hidden_size), dtype=np.float64)
    ids = [str(i) for i in range(len(texts))]
    for batch in extract_activations(loaded.model, loaded.tokenizer, loaded.decoder_layers, texts, [index],
                                     ids=ids, batch_size=batch_size):
        hidden = batch.hidden
        if norm is not None:
            with torch.inference_mode():
                hidden = norm(torch.from_numpy(hidden).to(loaded.dtype)).float().numpy()
        if specs is not None:
            from poolbench.pooler.pool import pool_tokens

            pooled = pool_tokens(dataclasses.replace(batch, hidden=hidden), specs).vectors[0, 0]
        for row, pid in enumerate(batch.passage_ids):
            i = int(pid)
            mask = marked_token_mask(batch.offsets[row], [spans[i]]) & batch.attention_mask[row]
            if not mask.any():
                raise WordListError(f"{words.where(i)}: word {words.words[i]!r} gives no tokens")
            if unk is not None and (batch.input_ids[row][mask] == unk).any():
                raise WordListError(f"{words.where(i)}: word {words.words[i]!r} has characters the tokenizer "
                                    "cannot encode (unknown token)")
            out[i] = pooled[row] if specs is not None else hidden[0, row][mask].mean(axis=0)
    return out


def valence_inputs(loaded: LoadedModel, lists: Sequence[WordList], **options) -> list[np.ndarray]:
    """Representations of several word lists (domain, positive, negative) from one checkpoint."""
    return [word_representations(loaded, words, **options) for words in lists]
