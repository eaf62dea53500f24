"""ConceptContext: what some strategies know about a concept beyond one batch, fitted on its train split only.

- L2's trigger set (dependency relations and lemmas) from the trigger table in poolbench/data;
- L5's TF-IDF (scikit-learn, IDF fitted on the train split's words, lower-cased, alphabetic, no stop words);
- S2_sif's unigram probabilities of model token ids over the train split's tokens (special tokens included, as the
  reference counts them; the reference counts every concept of its run, this counts the concept's own: see
  docs/reference-variants.md).
Test passages never shape any of these, so no held-out text leaks into a train-fitted statistic.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib.resources import files

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from poolbench.errors import StrategyError
from poolbench.pooler.parses import ParseIndex

DEFAULT_TOP_K = 10
TRIGGER_FILE = "l2_triggers.json"


@cache
def trigger_table() -> dict[str, dict[str, frozenset[str]]]:
    """The per-concept trigger table (data, one file); '_default' serves unlisted concepts."""
    raw = json.loads(files("poolbench").joinpath("data", TRIGGER_FILE).read_text())
    table = {}
    for concept, entry in raw.items():
        if concept.startswith("_") and concept != "_default":
            continue
        if not isinstance(entry, dict) or set(entry) != {"deps", "lemmas"}:
            raise StrategyError(f"{TRIGGER_FILE}: concept {concept!r} needs exactly 'deps' and 'lemmas'")
        table[concept] = {"deps": frozenset(entry["deps"]),
                          "lemmas": frozenset(w.lower() for w in entry["lemmas"])}
    return table


def triggers_for(concept: str) -> dict[str, frozenset[str]]:
    table = trigger_table()
    return table.get(concept, table["_default"])


def keyword_candidates(words: Mapping[str, np.ndarray]) -> np.ndarray:
    """[n_words] bool: the words TF-IDF scores (alphabetic, not stop words)."""
    return np.asarray(words["is_alpha"], dtype=bool) & ~np.asarray(words["is_stop"], dtype=bool)


@dataclass
class ConceptContext:
    """Train-split statistics of one concept, built once per concept and read by every batch."""

    concept: str
    top_k: int = DEFAULT_TOP_K
    vectorizer: TfidfVectorizer | None = None
    token_counts: dict[int, int] = field(default_factory=dict)
    token_total: int = 0
    deps: frozenset[str] = frozenset()
    lemmas: frozenset[str] = frozenset()
    keyword_cache: dict[str, set[str]] = field(default_factory=dict, repr=False)

    @classmethod
    def fit(cls, concept: str, parses: ParseIndex | None, train_ids: Sequence[str],
            train_token_ids: Sequence[Sequence[int]] = (), top_k: int = DEFAULT_TOP_K) -> ConceptContext:
        """Fit on the train split: TF-IDF over its parsed words, unigram counts over all its model tokens."""
        vectorizer = None
        if parses is not None and train_ids:
            docs = []
            for passage_id in train_ids:
                words = parses.words(passage_id)
                docs.append([str(w) for w in words["lower"][keyword_candidates(words)]])
            vectorizer = TfidfVectorizer(analyzer=lambda doc: doc, lowercase=False)
            vectorizer.fit(docs)
        counts: dict[int, int] = {}
        for ids in train_token_ids:
            for token_id in ids:
                counts[int(token_id)] = counts.get(int(token_id), 0) + 1
        trig = triggers_for(concept)
        return cls(concept, top_k, vectorizer, counts, sum(counts.values()), trig["deps"], trig["lemmas"])

    def keywords(self, words: Mapping[str, np.ndarray]) -> set[str]:
        """The passage's top-k TF-IDF words; ties broken by first occurrence in the passage."""
        return self.keywords_of([words])[0]

    def keywords_of(self, passages: Sequence[Mapping[str, np.ndarray]]) -> list[set[str]]:
        """Top-k TF-IDF words of many passages with one vectorizer call."""
        if self.vectorizer is None:
            raise StrategyError(f"concept {self.concept!r}: L5 needs a TF-IDF fitted on parsed train texts")
        docs = [[str(w) for w in words["lower"][keyword_candidates(words)]] for words in passages]
        matrix = self.vectorizer.transform(docs).tocsr()
        vocab = self.vectorizer.get_feature_names_out()
        out = []
        for i, candidates in enumerate(docs):
            row = matrix.getrow(i)
            score = {str(vocab[j]): float(v) for j, v in zip(row.indices, row.data, strict=True)}
            first: dict[str, int] = {}
            for k, w in enumerate(candidates):
                first.setdefault(w, k)
            out.append(set(sorted(score, key=lambda w: (-score[w], first[w]))[: self.top_k]))
        return out

    def cache_keywords(self, parses: ParseIndex, passage_ids: Sequence[str]) -> None:
        """Score every passage of the concept at once, so batches only look their keywords up."""
        if self.vectorizer is not None and passage_ids:
            found = self.keywords_of([parses.words(pid) for pid in passage_ids])
            self.keyword_cache.update(zip(passage_ids, found, strict=True))

    def word_flags(self, passage_id: str, words: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per-word concept flags for batch_parse_extras: L2 triggers and (when fitted) L5 keywords."""
        deps = np.isin(words["dep"].astype(str), sorted(self.deps))
        lemmas = np.isin(words["lemma"].astype(str), sorted(self.lemmas))
        flags = {"trigger": deps | lemmas}
        if self.vectorizer is not None:
            keep = self.keyword_cache.get(passage_id)
            keep = keep if keep is not None else self.keywords(words)
            flags["keyword"] = keyword_candidates(words) & np.isin(words["lower"].astype(str), list(keep))
        return flags

    def unigram_probability(self, input_ids: np.ndarray, unseen: float = 0.0) -> np.ndarray:
        """p(token id) over the train split's tokens; ids never seen there get `unseen`."""
        if self.token_total == 0:
            raise StrategyError(f"concept {self.concept!r}: S2_sif needs unigram counts from the train split")
        if not input_ids.size:
            return np.zeros(input_ids.shape)
        total = self.token_total
        lookup = np.vectorize(lambda i: self.token_counts[int(i)] / total if int(i) in self.token_counts else unseen,
                              otypes=[np.float64])
        return lookup(input_ids)
