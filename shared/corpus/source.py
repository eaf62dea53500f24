"""Where a run's corpus comes from: a PoolBench-layout folder, or the embedded one materialised in the cache."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from poolbench.atomic_write import write_json_atomic
from poolbench.corpus import sparse_signal
from poolbench.corpus.corpus_versions import DEFAULT_CORPUS_VERSION, generate_embedded_corpus
from poolbench.corpus.embedded import GENERATOR_VERSION
from poolbench.corpus.layout import MANIFEST_FILE, Corpus, load_corpus, write_corpus
from poolbench.corpus.passage import Passage
from poolbench.defaults import EMBEDDED, cache_dir
from poolbench.errors import CorpusError

EMBEDDED_CORPUS_SEED = 0


EMBEDDED_VERSIONS = {f"{EMBEDDED}-v1": 1, f"{EMBEDDED}-v2": 2}
"""`--corpus embedded-v1` selects the v1 corpus; plain `embedded` is the default version."""


def embedded_corpus_dir(size: str, version: int = DEFAULT_CORPUS_VERSION) -> Path:
    """Generate the embedded corpus once into the cache, in the same layout a downloaded corpus has.

    The folder is named by the generator's revision, so a change of generated text never reuses a stale one.
    """
    root = cache_dir() / "corpora" / f"embedded-{_revision(version)}-{size}-seed{EMBEDDED_CORPUS_SEED}"
    if not (root / MANIFEST_FILE).is_file():
        write_embedded_corpus(root, size, EMBEDDED_CORPUS_SEED, version)
    return root


def _revision(version: int) -> str:
    return f"v{GENERATOR_VERSION}" if version == 1 else f"v2.{sparse_signal.REVISION}"


def write_embedded_corpus(root: Path, size: str, seed: int, version: int = DEFAULT_CORPUS_VERSION) -> int:
    """Write the embedded corpus and, last, its manifest: v2's splits are held out by construction, so
    `validate-corpus` treats any sentence they share as an error there. Returns the number of passages."""
    corpus = generate_embedded_corpus(size=size, seed=seed, version=version)
    write_corpus(root, corpus)
    write_json_atomic(Path(root) / MANIFEST_FILE, {"generator": f"poolbench-embedded-{_revision(version)}",
                                                    "size": size, "seed": seed, "held_out": version == 2})
    return sum(len(v) for v in corpus.values())


def open_corpus(source: str, size: str = "small", concepts: Sequence[str] | None = None) -> Corpus:
    """A corpus folder (JSONL, or parquet through `datasets`), `hf://owner/name[@revision]` (corpus.hf_source), or the
    embedded corpus (`embedded`, `embedded-v1`, `embedded-v2`) built into the cache."""
    from poolbench.corpus.hf_source import HF_PREFIX, hf_snapshot, is_parquet_corpus, load_datasets_corpus

    if source.startswith(HF_PREFIX):
        return load_datasets_corpus(hf_snapshot(source), concepts, name=source)
    if is_parquet_corpus(Path(source)):
        return load_datasets_corpus(Path(source), concepts)
    if source == EMBEDDED:
        root = embedded_corpus_dir(size)
    elif source in EMBEDDED_VERSIONS:
        root = embedded_corpus_dir(size, EMBEDDED_VERSIONS[source])
    else:
        root = Path(source)
    if not root.is_dir():
        raise CorpusError(f"corpus directory '{root}' does not exist")
    return load_corpus(root, concepts)


def limit_passages(passages: Sequence[Passage], limit: int | None, train_limit: int | None = None,
                   test_limit: int | None = None) -> list[Passage]:
    """At most `limit` passages per (split, label), at most `train_limit` per label of the train split (a learning
    curve's training size) and `test_limit` per label of the test split (the one held-out set every size of a
    curve is read on), keeping matched pairs whole, in corpus order, so a smaller size's training set is part of a
    larger one's."""
    if limit is None and train_limit is None and test_limit is None:
        return list(passages)
    kept: list[Passage] = []
    for split in ("train", "test"):
        only = {"train": train_limit, "test": test_limit}[split]
        bounds = [n for n in (limit, only) if n is not None]
        if not bounds:
            kept.extend(p for p in passages if p.split == split)
            continue
        limit_here = min(bounds)
        pos = [p for p in passages if p.split == split and p.label == 1][:limit_here]
        pair_ids = {p.matched_pair_id for p in pos if p.matched_pair_id}
        neg_all = [p for p in passages if p.split == split and p.label == 0]
        twins = [p for p in neg_all if p.matched_pair_id in pair_ids]
        others = [p for p in neg_all if p.matched_pair_id not in pair_ids]
        kept.extend(pos + (twins + others)[:limit_here])
    return kept


def passages_digest(passages: Sequence[Passage]) -> str:
    """Identifies the exact passage subset a run used (a --limit run must not reuse a full run's artifacts)."""
    return hashlib.sha256("\n".join(p.id for p in passages).encode()).hexdigest()[:16]
