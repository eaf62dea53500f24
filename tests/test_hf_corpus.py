"""--corpus hf://owner/name[@revision] and local parquet folders, read through `datasets`: offline from a Hugging Face
cache the test builds, the same passages and corpus hash as the JSONL folder they were made from, and the JSONL
loader's one-line errors naming the file and row."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from poolbench.corpus.corpus_versions import generate_embedded_corpus
from poolbench.corpus.layout import FILE_STEMS, load_corpus, write_corpus
from poolbench.corpus.source import open_corpus
from poolbench.errors import CorpusError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def jsonl_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jsonl")
    write_corpus(root, {c: p for c, p in generate_embedded_corpus("tiny").items() if c in ("hedging", "toxicity")})
    return root


def to_parquet(jsonl: Path, out: Path) -> Path:
    for concept in ("hedging", "toxicity"):
        (out / concept).mkdir(parents=True)
        for stem in FILE_STEMS:
            rows = [json.loads(line) for line in (jsonl / concept / f"{stem}.jsonl").read_text().splitlines()]
            pq.write_table(pa.Table.from_pylist(rows), out / concept / f"{stem}.parquet")
    return out


def test_a_parquet_folder_reads_as_the_jsonl_corpus_it_was_made_from(jsonl_corpus, tmp_path):
    want = load_corpus(jsonl_corpus)
    got = open_corpus(str(to_parquet(jsonl_corpus, tmp_path / "pq")))
    assert got.concepts == ["hedging", "toxicity"]
    for concept in got.concepts:
        assert got.passages(concept) == want.passages(concept)
        assert got.concept_hash(concept) == want.concept_hash(concept)
    assert got.hash == want.hash


def test_hf_uri_reads_offline_from_the_hugging_face_cache(jsonl_corpus, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    repo = cache / "datasets--pb--poolbench"
    shutil.copytree(jsonl_corpus, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want = load_corpus(jsonl_corpus)
    for source in ("hf://pb/poolbench", f"hf://pb/poolbench@{COMMIT}"):
        got = open_corpus(source, concepts=["hedging"])
        assert got.concepts == ["hedging"] and got.passages("hedging") == want.passages("hedging")
        assert got.concept_hash("hedging") == want.concept_hash("hedging")
    with pytest.raises(CorpusError, match=r"^--corpus 'hf://pb/absent': .*HF_HUB_OFFLINE=1 only the local"):
        open_corpus("hf://pb/absent")
    with pytest.raises(CorpusError, match=r"^unknown concept 'joy' in hf://pb/poolbench \(known: hedging, toxicity\)"):
        open_corpus("hf://pb/poolbench", concepts=["joy"])


def test_bad_sources_and_records_are_one_line_naming_them(jsonl_corpus, tmp_path):
    with pytest.raises(CorpusError, match=r"^--corpus 'hf://nope': expected hf://<owner>/<name>\[@revision\]$"):
        open_corpus("hf://nope")
    root = to_parquet(jsonl_corpus, tmp_path / "pq")
    path = root / "hedging" / "train_neg.parquet"
    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist([{**r, "label": str(r["label"])} for r in rows]), path)  # "0", not 0
    with pytest.raises(CorpusError, match=rf"^{path} row 1: field label: "):
        open_corpus(str(root))
    (root / "hedging" / "train_neg.parquet").unlink()
    with pytest.raises(CorpusError, match=r"hedging/train_neg\.\{jsonl,parquet\}: missing file$"):
        open_corpus(str(root), concepts=["hedging"])
