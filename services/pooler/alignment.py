"""Character spans to model tokens by offset overlap: one rule for byte-level BPE, SentencePiece, WordPiece.

A model token (s, e) overlaps a span (a, b) when s < b and e > a. Leading spaces that byte-level BPE or
SentencePiece fold into a token never overlap a word, and a character split over several byte tokens gives
each of them the same span, so no tokenizer family needs a special case. Special tokens ((0, 0)) and
whitespace-only tokens overlap nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolbench.errors import PoolBenchError


class AlignmentError(PoolBenchError):
    """Token offsets or word spans that do not fit the passage they claim to describe."""


def overlap_pairs(
    passage_id: str, text_length: int, token_offsets: np.ndarray, real: np.ndarray,
    word_starts: np.ndarray, word_ends: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(token position, word index) for every overlapping pair of one passage, sorted by token then word."""
    token_offsets = np.asarray(token_offsets, dtype=np.int64)
    starts, ends = token_offsets[:, 0], token_offsets[:, 1]
    bad = real & ((starts < 0) | (ends < starts) | (ends > text_length))
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise AlignmentError(f"passage {passage_id!r}: token {t} has offsets ({starts[t]}, {ends[t]}) "
                             f"outside its {text_length}-character text; tokens and text do not match")
    word_starts = np.asarray(word_starts, dtype=np.int64)
    word_ends = np.asarray(word_ends, dtype=np.int64)
    if len(word_ends) and (word_ends.max() > text_length or (word_starts > word_ends).any()
                           or word_starts.min() < 0):
        raise AlignmentError(f"passage {passage_id!r}: its parse has word spans outside its {text_length}-"
                             "character text; the parse belongs to another text")
    usable = real & (ends > starts)
    hit = usable[:, None] & (starts[:, None] < word_ends[None, :]) & (ends[:, None] > word_starts[None, :])
    token, word = np.nonzero(hit)
    return token, word


def marked_token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """[T] bool: a token is marked when its character span [s, e) overlaps a marked span; empty spans
    (special tokens, padding, whitespace-only tokens) never are."""
    offsets = np.asarray(offsets).reshape(-1, 2)
    start, end = offsets[:, 0], offsets[:, 1]
    marked = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        marked |= (start < e) & (s < end) & (end > start)
    return marked


def span_token_mask(offsets: np.ndarray, attention_mask: np.ndarray,
                    spans: Sequence[Sequence[tuple[int, int]]], texts: Sequence[str],
                    passage_ids: Sequence[str]) -> np.ndarray:
    """[B, T] bool: tokens overlapping any of each passage's character spans."""
    mask = np.zeros(attention_mask.shape, dtype=bool)
    for b, passage_spans in enumerate(spans):
        if not passage_spans:
            continue
        span_array = np.asarray(passage_spans, dtype=np.int64).reshape(-1, 2)
        token, _ = overlap_pairs(passage_ids[b], len(texts[b]), offsets[b], attention_mask[b],
                                 span_array[:, 0], span_array[:, 1])
        mask[b, token] = True
    return mask
