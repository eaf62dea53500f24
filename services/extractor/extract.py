"""Extraction core: tokenize once, bucket by length, one hooked forward per batch, ActivationBatch out."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

import numpy as np
from torch import nn

from poolbench.corpus.passage import Passage
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.capture import capture_chunks
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.layer_sinks import HostCapture
from poolbench.extractor.padded_batches import PaddedBatch, prepare_batches


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
    max_batch_tokens: int | None = None,
) -> Iterator[ActivationBatch]:
    """Capture every requested layer in one forward per row chunk of each batch; stops after the deepest one.

    `max_batch_tokens` bounds a forward (default: from free memory, see batching.py): a batch is cut into
    chunks of its rows at the same padded length, so chunks hold exactly what the whole batch would, and one
    ActivationBatch comes out per chunk. Attention and S2 shrink the chunk to the same bytes.

    `needs` (the union of the pooled strategies' needs) adds extras computed in that same forward and only
    then: "attention" -> attention_inflow / attention_inflow_last [L,B,T] and their per-head forms
    attention_head_inflow / attention_head_inflow_last [L,B,H,T]; with "labels" also
    attention_head_output_last [L,B,H,Dh]; "gradient" -> gradient_norm / gradient_x_input [L,B,T] (the forward
    then runs to the LM head with grad enabled and one backward serves all layers). Without "gradient" no
    graph is built and no LM head runs.
    """
    layers = tuple(int(layer) for layer in layers)
    for _, capture in capture_chunks(model, decoder_layers, batches, layers,
                                     sink_for=lambda chunk: HostCapture(chunk, layers, dtype_out), stats=stats,
                                     stop_early=stop_early, needs=needs, max_batch_tokens=max_batch_tokens,
                                     dtype_out=dtype_out):
        assert capture.activations is not None
        yield capture.activations


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
    max_batch_tokens: int | None = None,
) -> Iterator[ActivationBatch]:
    """Hidden states at "layers.{L}.out" of every passage, one ActivationBatch per length bucket, in order.

    Tokenizing and planning happen at the call, so a bad tokenizer fails here rather than at the first batch.
    """
    batches = prepare_batches(
        tokenizer, passages, ids=ids, batch_size=batch_size, max_tokens=max_tokens, max_length=max_length
    )
    return extract_batches(model, decoder_layers, batches, layers, dtype_out=dtype_out, stats=stats,
                           needs=needs, max_batch_tokens=max_batch_tokens)
