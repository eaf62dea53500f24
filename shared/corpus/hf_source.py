"""Corpora read through Hugging Face `datasets`: `hf://<owner>/<name>[@revision]` (a dataset repository in the
PoolBench card's layout, `{concept}/{train,test}_{pos,neg}.{jsonl,parquet}`, as `load_dataset(repo,
data_dir=concept)` reads it) and local folders of parquet files in that layout.

A repository comes from the Hugging Face cache through `huggingface_hub.snapshot_download` (offline with
HF_HUB_OFFLINE=1: only what the cache holds, else one line saying so); each file is then read with
`datasets.load_dataset("json"|"parquet", data_files=...)` and goes through the JSONL loader's checks
(layout.concept_from_rows), so the same records give the same passages, errors and corpus hash as a JSONL folder.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from poolbench.corpus.layout import FILE_STEMS, Corpus, Rows, concept_from_rows
from poolbench.errors import CorpusError

HF_PREFIX = "hf://"
EXTENSIONS = ("jsonl", "parquet")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def parse_hf(source: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `hf://owner/name[@revision]`; one line when it is not one."""
    repo, _, revision = source.removeprefix(HF_PREFIX).partition("@")
    if not _REPO.match(repo) or (revision == "" and "@" in source):
        raise CorpusError(f"--corpus '{source}': expected hf://<owner>/<name>[@revision]")
    return repo, revision or None


def hf_snapshot(source: str) -> Path:
    """The local snapshot folder of the dataset repository `source` names (downloaded or, offline, cached)."""
    from huggingface_hub import snapshot_download

    repo, revision = parse_hf(source)
    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision))
    except Exception as exc:  # hub errors differ by version; each is one line here
        raise CorpusError(f"--corpus '{source}': {str(exc).splitlines()[0]} (with HF_HUB_OFFLINE=1 only the "
                          "local Hugging Face cache is read)") from exc


def _file(folder: Path, stem: str) -> Path | None:
    found = [folder / f"{stem}.{ext}" for ext in EXTENSIONS if (folder / f"{stem}.{ext}").is_file()]
    if len(found) > 1:
        raise CorpusError(f"{folder}: both {found[0].name} and {found[1].name}; keep one")
    return found[0] if found else None


def is_parquet_corpus(root: Path) -> bool:
    """A folder whose concept folders hold the layout's files as parquet."""
    return root.is_dir() and any(d.is_dir() and (d / f"{s}.parquet").is_file() for d in root.iterdir()
                                 for s in FILE_STEMS)


def _rows(path: Path, cache: Path) -> Rows:
    """A file's records through `datasets` (its arrow cache in `cache`), each named `path row N` in an error."""
    try:
        from datasets import load_dataset
    except ImportError as exc:
        raise CorpusError(f"{path}: reading parquet or hf:// corpora needs the `datasets` package "
                          "(pip install datasets)") from exc

    try:
        table = load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files={"rows": str(path)},
                             split="rows", cache_dir=str(cache))
        records = table.to_list()
    except Exception as exc:  # datasets wraps parse errors in its own types
        yield f"{path}", None, f"not readable by datasets ({str(exc).splitlines()[0]})"
        return
    for i, record in enumerate(records, start=1):
        yield f"{path} row {i}", record, None


def load_datasets_corpus(root: Path, concepts: Sequence[str] | None = None, *, name: str | None = None) -> Corpus:
    """The concepts under `root` (every folder holding a layout file), each file read through `datasets`."""
    known = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))
                   and any(_file(d, s) for s in FILE_STEMS))
    where = name or str(root)
    wanted = sorted(set(known if concepts is None else concepts))
    for concept in wanted:
        if concept not in known:
            raise CorpusError(f"unknown concept {concept!r} in {where} (known: {', '.join(known) or 'none'})")
    passages, hashes = {}, {}
    with tempfile.TemporaryDirectory(prefix="poolbench-datasets-") as cache:
        for concept in wanted:
            files = []
            for stem in FILE_STEMS:
                path = _file(root / concept, stem)
                if path is None:
                    raise CorpusError(f"{where}/{concept}/{stem}.{{jsonl,parquet}}: missing file")
                files.append((stem, _rows(path, Path(cache))))
            passages[concept], hashes[concept] = concept_from_rows(concept, files)
    return Corpus(root=root, concepts=wanted, _passages=passages, _hashes=hashes)
