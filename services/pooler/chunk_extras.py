"""What the strategies read from the text of one chunk, built on the CPU before its forward: parse arrays aligned
to tokens and the concept's train-split statistics (ConceptContext), each row from its own concept.

Several concepts may share a forward; a chunk's rows then come from different concepts, and every row is
served by its own concept's parses, trigger set, TF-IDF and unigram counts, so a concept pools the same
whether it runs alone or in a group.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from poolbench.corpus.passage import Passage
from poolbench.extractor.padded_batches import PaddedBatch, TokenizedPassages
from poolbench.pooler.concept_context import ConceptContext
from poolbench.pooler.parses import ParseIndex, load_nlp, parse_table, rows_parse_extras
from poolbench.pooler.reference_tokens import token_root_extra
from poolbench.pooler.saliency import SIF_A


@dataclass(frozen=True)
class ConceptText:
    """One concept's text-side state: its parses (when a strategy needs them) and its train-split statistics
    (when one needs "corpus")."""

    parses: ParseIndex | None
    context: ConceptContext | None


def concept_text(concept: str, passages: Sequence[Passage], tokens: TokenizedPassages, rows: Sequence[int],
                 needs: Collection[str], parses: ParseIndex | None = None) -> ConceptText:
    """Parse the concept when a strategy needs parses and none were given, and fit its statistics on its train
    split: TF-IDF over parsed words, unigram counts over all its model tokens (`rows` of `tokens`), special tokens
    included as the reference counts them."""
    if "parse" in needs and parses is None:
        parses = ParseIndex.from_table(parse_table(load_nlp(), [p.text for p in passages],
                                                   [p.id for p in passages]))
    if "corpus" not in needs:
        return ConceptText(parses, None)
    train = [p.split == "train" for p in passages]
    token_ids = [list(tokens.input_ids[row]) for row, is_train in zip(rows, train, strict=True) if is_train]
    context = ConceptContext.fit(concept, parses, [p.id for p in passages if p.split == "train"], token_ids)
    if parses is not None:
        context.cache_keywords(parses, [p.id for p in passages])
    return ConceptText(parses, context)


class ChunkExtras:
    """Builds a chunk's host extras; `owner[i]` is the concept (index into `texts`) of planned passage i."""

    def __init__(self, texts: Sequence[ConceptText], owner: np.ndarray, needs: Collection[str],
                 tokenizer=None) -> None:
        self._texts = list(texts)
        self._owner = np.asarray(owner)
        self._parse = "parse" in needs
        self._corpus = "corpus" in needs
        self._tokenizer = tokenizer if "tokens" in needs else None

    def owners(self, chunk: PaddedBatch) -> np.ndarray:
        """[B] the concept of each row."""
        return self._owner[np.asarray(chunk.indices, dtype=np.int64)]

    def __call__(self, chunk: PaddedBatch) -> dict[str, np.ndarray]:
        """Parse index tensors and unigram probabilities of the chunk's rows, each from its own concept."""
        extras: dict[str, np.ndarray] = {}
        owners = self.owners(chunk)
        if self._tokenizer is not None:
            extras["token_root"] = token_root_extra(self._tokenizer, chunk.input_ids, chunk.attention_mask)
        if self._parse:
            words, flags = [], []
            for owner, passage_id in zip(owners, chunk.passage_ids, strict=True):
                text = self._texts[owner]
                assert text.parses is not None
                words.append(text.parses.words(passage_id))
                if text.context is not None:
                    flags.append(text.context.word_flags(passage_id, words[-1]))
            extras.update(rows_parse_extras(words, chunk.passage_ids, chunk.texts, chunk.offsets,
                                            chunk.attention_mask, flags if self._corpus else None))
        if self._corpus:
            present = np.unique(owners)
            if len(present) == 1:
                context = self._texts[present[0]].context
                assert context is not None
                extras["unigram_probability"] = context.unigram_probability(chunk.input_ids, SIF_A)
            else:
                probability = np.zeros(chunk.input_ids.shape, dtype=np.float64)
                for owner in present:
                    context = self._texts[owner].context
                    assert context is not None
                    rows = owners == owner
                    probability[rows] = context.unigram_probability(chunk.input_ids[rows], SIF_A)
                extras["unigram_probability"] = probability
        return extras
