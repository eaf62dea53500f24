"""The model side of CE-Bench and SAE training: token activations at one layer, aligned to marked spans."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.cebench.data import CEBenchEntry, entry_texts
from poolbench.cebench.sae import SAE
from poolbench.cebench.scores import CEBenchError, CEBenchScores, cebench_scores, entry_means
from poolbench.extractor.extract import extract_activations
from poolbench.extractor.loading import LoadedModel
from poolbench.pooler.alignment import marked_token_mask


def story_tokens(loaded: LoadedModel, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]],
                 layer: int, *, batch_size: int = 16,
                 max_length: int = 1024) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per text: real, non-special token activations [T_i, d] at layers.{layer}.out and their marked mask [T_i].

    A text the tokenizer window cuts short is an error: its unmarked/marked balance would be silently wrong.
    """
    ids = [str(i) for i in range(len(texts))]
    acts: list[np.ndarray] = [np.empty(0)] * len(texts)
    masks: list[np.ndarray] = [np.empty(0, dtype=bool)] * len(texts)
    for batch in extract_activations(loaded.model, loaded.tokenizer, loaded.decoder_layers, texts, [layer],
                                     ids=ids, batch_size=batch_size, max_length=max_length):
        for row, pid in enumerate(batch.passage_ids):
            i = int(pid)
            keep = batch.attention_mask[row] & ~batch.special_mask[row]
            offsets = batch.offsets[row][keep]
            if len(offsets) and offsets[:, 1].max() < len(texts[i].rstrip()):
                raise CEBenchError(f"text {i} is longer than --max-length {max_length} tokens")
            acts[i] = batch.hidden[0, row][keep]
            masks[i] = marked_token_mask(offsets, spans[i])
    return acts, masks


def run_cebench(loaded: LoadedModel, entries: Sequence[CEBenchEntry], layer: int, *, sae: SAE | None = None,
                batch_size: int = 16, max_length: int = 1024, normalisation: str = "entry_zscore") -> CEBenchScores:
    """CE-Bench scores on the layer's neurons, or on SAE features (each token encoded, then averaged)."""
    if sae is not None and sae.d != loaded.hidden_size:
        raise CEBenchError(f"SAE has d={sae.d} but model '{loaded.model_id}' has hidden size {loaded.hidden_size}")
    texts, spans = entry_texts(entries)
    acts, masks = story_tokens(loaded, texts, spans, layer, batch_size=batch_size, max_length=max_length)
    if sae is not None:
        acts = [sae.encode(a) for a in acts]
    return cebench_scores(entry_means(acts, masks, [e.id for e in entries]), normalisation)


def token_activations(loaded: LoadedModel, texts: Sequence[str], layer: int, *, max_tokens: int = 50_000,
                      batch_size: int = 32) -> np.ndarray:
    """[N, d] float32 real, non-special token activations of `texts` at one layer (training data for an SAE)."""
    chunks, total = [], 0
    for batch in extract_activations(loaded.model, loaded.tokenizer, loaded.decoder_layers, texts, [layer],
                                     batch_size=batch_size):
        keep = batch.attention_mask & ~batch.special_mask
        chunks.append(batch.hidden[0][keep])
        total += len(chunks[-1])
        if total >= max_tokens:
            break
    return np.concatenate(chunks)[:max_tokens].astype(np.float32)
