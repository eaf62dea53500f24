"""Which generator writes the embedded corpus: v1 (`poolbench.corpus.embedded`, every sentence carries the concept)
or v2, the default (`poolbench.corpus.sparse_signal`, a few concept sentences planted in neutral passages)."""

from __future__ import annotations

from poolbench.corpus.embedded import CONCEPTS, generate_concept
from poolbench.corpus.passage import Passage
from poolbench.corpus.sparse_signal import generate_corpus_v2
from poolbench.errors import CorpusError

CORPUS_VERSIONS = (1, 2)
DEFAULT_CORPUS_VERSION = 2


def generate_embedded_corpus(size: str = "small", seed: int = 0,
                             version: int = DEFAULT_CORPUS_VERSION) -> dict[str, list[Passage]]:
    """All 17 concepts of corpus `version`; byte-identical for the same (size, seed) on every run and machine."""
    if version == 2:
        return generate_corpus_v2(size, seed)
    if version != 1:
        raise CorpusError(f"unknown corpus version {version!r} (known: {', '.join(map(str, CORPUS_VERSIONS))})")
    return {concept: generate_concept(concept, size, seed) for concept in CONCEPTS}
