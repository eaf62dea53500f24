"""A concept's spaCy parse through the artifact store: read when stored, else parsed and stored once per corpus.

The extractor reads it before a concept's first forward (the TF-IDF statistics need the whole train split's
parses). On a GPU run the driver parses ahead instead, one plain Ray task per concept on the CPU cores, while
the GPU pools earlier concepts; the extractor then finds every parse stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from poolbench.corpus.passage import Passage
from poolbench.pooler.parses import cached_parse_table, ids_digest
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.url import open_store


def concept_parses(store: ArtifactStore, passages: Sequence[Passage], corpus_hash: str) -> tuple[pa.Table, bool]:
    """The parse table of exactly these passages (keyed by the corpus hash and their ids); (table, was_stored)."""
    ids = [p.id for p in passages]
    return cached_parse_table(store, [p.text for p in passages], ids, corpus_hash=corpus_hash,
                              passages_digest=ids_digest(ids))


def parse_concept_task(store_url: str, concept: str, passages: Sequence[Passage], corpus_hash: str) -> dict:
    """Ray task: store the concept's parse unless it is stored; says whether it parsed."""
    _, stored = concept_parses(open_store(store_url), passages, corpus_hash)
    return {"concept": concept, "parsed": not stored}
