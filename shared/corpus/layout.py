"""Load and write the PoolBench corpus layout `{root}/{concept}/{train,test}_{pos,neg}.jsonl`.

The loader is strict on presence and types so downstream code can trust a `Passage`; deeper
consistency checks (labels vs file names, duplicates, pairs, balance) live in `corpus_validation`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from poolbench.corpus.passage import LABEL_NAMES, SPLITS, Passage
from poolbench.errors import CorpusError

FILE_STEMS: tuple[str, ...] = ("train_pos", "train_neg", "test_pos", "test_neg")
"""The four files of a concept, in the order their passages are returned."""

FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "text": (str,),
    "label": (int,),
    "domain": (str,),
    "token_count": (int,),
    "matched_pair_id": (str, type(None)),
    "split": (str,),
}
"""The record schema; `bool` is rejected for int fields although Python treats it as an int."""

OPTIONAL_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "signal_spans": (list,),
    "density": (int,),
    "placement": (str,),
    "tier": (str,),
}
"""Fields a corpus may add to say where its concept sits (corpus v2); kept by the loader, checked by the validator."""


MANIFEST_FILE = "poolbench_corpus.json"
"""What a generator says about the corpus it wrote (`held_out`: its splits share no signal sentence by design)."""


def read_manifest(root: Path | str) -> dict:
    """The corpus folder's manifest, or {} for a folder without one (any user's corpus)."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise CorpusError(f"{path}: the manifest must be a JSON object")
    return manifest


MAX_TEXT_CHARS = 100_000
"""A passage longer than this is refused, not silently cut to the model's window after minutes of tokenising."""


def file_stem(split: str, label: int) -> str:
    """The file a passage of this split and label belongs in, e.g. `train_pos`."""
    return f"{split}_{LABEL_NAMES[label]}"


def schema_problems(record: object) -> list[tuple[str | None, str]]:
    """(field, message) for every missing or mistyped field; shared by loader and validator."""
    if not isinstance(record, dict):
        return [(None, f"record must be a JSON object, got {type(record).__name__}")]
    problems: list[tuple[str | None, str]] = []
    for name, types in FIELD_TYPES.items():
        if name not in record:
            problems.append((name, "missing field"))
            continue
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            problems.append((name, f"expected {wanted}, got {type(value).__name__} {value!r:.40}"))
    text = record.get("text")
    if isinstance(text, str) and len(text) > MAX_TEXT_CHARS:
        problems.append(("text", f"{len(text):,} characters, at most {MAX_TEXT_CHARS:,} (split the passage)"))
    for name, types in OPTIONAL_FIELD_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            problems.append((name, f"expected {types[0].__name__}, got {type(value).__name__} {value!r:.40}"))
        elif name == "signal_spans" and not all(_is_span(span) for span in value):
            problems.append((name, f"expected a list of [start, end] integer pairs, got {value!r:.40}"))
    return problems


def _is_span(span: object) -> bool:
    return (isinstance(span, list) and len(span) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in span))


def passage_from_record(record: Mapping, concept: str) -> Passage:
    """A schema-valid record as a Passage, optional fields included (spans become tuples)."""
    spans = record.get("signal_spans")
    return Passage(concept=concept, **{k: record[k] for k in FIELD_TYPES},
                   signal_spans=None if spans is None else tuple((int(a), int(b)) for a, b in spans),
                   density=record.get("density"), placement=record.get("placement"), tier=record.get("tier"))


def iter_jsonl(path: Path) -> Iterator[tuple[int, object | None, str | None]]:
    """Yield (line number, parsed record, JSON error) for each non-blank line of `path`; a byte that is not UTF-8
    is the last error yielded (naming its byte offset in the file): nothing after it can be read reliably."""
    offset = 0
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, None, (f"byte 0x{raw[exc.start]:02x} at byte offset {offset + exc.start} is not "
                                      "UTF-8 (save the file as UTF-8)")
                return
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield line_no, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def link_problem(path: Path) -> str | None:
    """Why a symlink cannot be followed (a loop, a dangling target), or None: so it is not read as 'missing'."""
    if not path.is_symlink():
        return None
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return f"broken symlink (to {os.readlink(path)})"
    except (RuntimeError, OSError):
        return "symlink loop"
    return None


def discover_concepts(root: Path) -> list[str]:
    """Concept folders under `root`: every non-hidden subdirectory holding at least one of the four files, sorted;
    a stray folder (none of them) or an unfollowable symlink is refused by name, never counted as a concept."""
    if not root.is_dir():
        raise CorpusError(f"corpus root {root} is not a directory")
    concepts = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        problem = link_problem(entry)
        if problem:
            raise CorpusError(f"{entry}: {problem} at the corpus root")
        if not entry.is_dir():
            continue
        if not any((entry / f"{stem}.jsonl").exists() or (entry / f"{stem}.jsonl").is_symlink()
                   for stem in FILE_STEMS):
            raise CorpusError(f"{entry}: stray folder at the corpus root (none of {', '.join(FILE_STEMS)}.jsonl); "
                              "move it out or prefix its name with '_' to skip it")
        concepts.append(entry.name)
    return concepts


def canonical_record(record: Mapping) -> str:
    """The byte-stable JSON of a record, so hashes ignore key order and whitespace."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


Rows = Iterator[tuple[str, object | None, str | None]]
"""(where, parsed record, read error) per record of one file: `where` names it in an error (`path:line`)."""


def concept_from_rows(concept: str, files: Sequence[tuple[str, Rows]]) -> tuple[list[Passage], str]:
    """One concept's passages and content hash from its four files' rows, in FILE_STEMS order, strictly: the first
    unreadable or schema-invalid record is a one-line CorpusError naming where it is. JSONL folders and the
    `datasets`-read sources (corpus.hf_source) share it, so the same records give the same passages and hash."""
    digest = hashlib.sha256(f"concept:{concept}\n".encode())
    passages: list[Passage] = []
    for stem, rows in files:
        digest.update(f"file:{stem}\n".encode())
        for where, record, error in rows:
            if error is not None:
                raise CorpusError(f"{where}: {error}")
            problems = schema_problems(record)
            if problems:
                name, message = problems[0]
                raise CorpusError(f"{where}: field {name or '<record>'}: {message}")
            assert isinstance(record, dict)
            kept = [*FIELD_TYPES, *(k for k in OPTIONAL_FIELD_TYPES if record.get(k) is not None)]
            digest.update(canonical_record({k: record[k] for k in kept}).encode() + b"\n")
            passages.append(passage_from_record(record, concept))
    return passages, digest.hexdigest()


def _jsonl_rows(path: Path) -> Rows:
    for line_no, record, error in iter_jsonl(path):
        yield f"{path}:{line_no}", record, error


def _read_concept(root: Path, concept: str) -> tuple[list[Passage], str]:
    """Parse one concept's four files strictly; returns its passages and content hash."""
    files = []
    for stem in FILE_STEMS:
        path = root / concept / f"{stem}.jsonl"
        problem = link_problem(path)
        if problem:
            raise CorpusError(f"{path}: {problem}")
        if not path.is_file():
            raise CorpusError(f"{path}: missing file")
        files.append((stem, _jsonl_rows(path)))
    return concept_from_rows(concept, files)


@dataclass(frozen=True)
class Corpus:
    """The loaded passages of some concepts, with content hashes that identify them across machines."""

    root: Path
    concepts: list[str]
    _passages: dict[str, list[Passage]] = field(repr=False)
    _hashes: dict[str, str] = field(repr=False)

    def _check(self, concept: str) -> None:
        if concept not in self._passages:
            raise CorpusError(
                f"unknown concept {concept!r} in {self.root} (known: {', '.join(self.concepts) or 'none'})"
            )

    def passages(self, concept: str, split: str | None = None) -> list[Passage]:
        """Passages of a concept in file order (train_pos, train_neg, test_pos, test_neg)."""
        self._check(concept)
        if split is not None and split not in SPLITS:
            raise CorpusError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
        return [p for p in self._passages[concept] if split is None or p.split == split]

    def concept_hash(self, concept: str) -> str:
        """sha256 of the concept's canonicalised records; independent of paths, mtimes and formatting."""
        self._check(concept)
        return self._hashes[concept]

    @property
    def hash(self) -> str:
        """sha256 over the loaded concepts' hashes, so a run records exactly which data it saw."""
        lines = "".join(f"{c}:{self._hashes[c]}\n" for c in self.concepts)
        return hashlib.sha256(lines.encode()).hexdigest()


def load_corpus(root: Path | str, concepts: Sequence[str] | None = None) -> Corpus:
    """Load `concepts` (default: every concept folder); any defect raises a one-line CorpusError."""
    root = Path(root)
    known = discover_concepts(root)
    wanted = sorted(set(known if concepts is None else concepts))
    for concept in wanted:
        if concept not in known:
            raise CorpusError(f"unknown concept {concept!r} in {root} (known: {', '.join(known) or 'none'})")
    passages: dict[str, list[Passage]] = {}
    hashes: dict[str, str] = {}
    for concept in wanted:
        passages[concept], hashes[concept] = _read_concept(root, concept)
    return Corpus(root=root, concepts=wanted, _passages=passages, _hashes=hashes)


def write_corpus(root: Path | str, passages_by_concept: Mapping[str, Sequence[Passage]]) -> None:
    """Write each concept's files into a temp folder, then swap it in: readers never see half a concept."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for concept, passages in passages_by_concept.items():
        if not concept or concept.startswith((".", "_")) or "/" in concept or os.sep in concept:
            raise CorpusError(f"invalid concept name {concept!r}")
        by_file: dict[str, list[str]] = {stem: [] for stem in FILE_STEMS}
        for p in passages:
            if p.concept != concept:
                raise CorpusError(f"passage {p.id}: concept {p.concept!r} filed under {concept!r}")
            if p.split not in SPLITS or p.label not in LABEL_NAMES:
                raise CorpusError(f"passage {p.id}: split {p.split!r} / label {p.label!r} has no file")
            by_file[file_stem(p.split, p.label)].append(json.dumps(p.to_record(), ensure_ascii=False))
        tmp = Path(tempfile.mkdtemp(prefix=f".{concept}.", dir=root))
        try:
            for stem, lines in by_file.items():
                (tmp / f"{stem}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            target = root / concept
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{concept}.old.", dir=root))
                os.replace(target, old / concept)
                os.replace(tmp, target)
                shutil.rmtree(old)
            else:
                os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
