"""The artifact store: durable, integrity-checked Arrow / JSON / bytes / directory artifacts by logical key.

Layout (the same relative names on every backend; a LocalStore root and an S3 bucket+prefix look alike):

    <key>.bin                      put_bytes
    <key>.json                     put_json
    <key>.arrow                    put_table (Arrow IPC file format, provenance in the schema metadata)
    <key>.dir/<relative path>      put_dir: every file of the directory ...
    <key>.dir/MANIFEST.json        ... then the manifest (sha256 + size of every file), written LAST

Keys are extension-less and dot-free (see ``poolbench.store.keys``), so a suffix always says what an
object is. Every object carries the sha256 of its content (LocalStore, in ``poolbench.store.local``: a
``<name>.poolbench-meta.json`` sidecar written before the content; S3: object metadata) and every get verifies it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from poolbench.errors import CorruptArtifactError, StoreError
from poolbench.store.arrow_tables import ipc_bytes_to_table, table_to_ipc_bytes, with_provenance
from poolbench.store.keys import iter_files, sha256_bytes, sha256_file, validate_key

SUFFIX_BYTES = ".bin"
SUFFIX_JSON = ".json"
SUFFIX_TABLE = ".arrow"
SUFFIX_DIR = ".dir"
BLOB_SUFFIXES = (SUFFIX_TABLE, SUFFIX_JSON, SUFFIX_BYTES)
MANIFEST_NAME = "MANIFEST.json"
QUARANTINE_PREFIX = "quarantine/"
MANIFEST_FORMAT = "poolbench-dir/1"
TMP_PREFIX = ".poolbench-tmp-"
_KIND_NAMES = {SUFFIX_BYTES: "bytes", SUFFIX_JSON: "json", SUFFIX_TABLE: "table", SUFFIX_DIR: "directory"}
_PREFIX_RE = re.compile(r"[A-Za-z0-9_/-]*")


@dataclass(frozen=True)
class StoredObject:
    """One object as a backend hands it back: content, recorded sha256 (None if absent) and metadata."""

    data: bytes | memoryview
    sha256: str | None
    metadata: dict[str, str] = field(default_factory=dict)


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Metadata is str -> str so it fits Arrow schema metadata and S3 object metadata alike."""
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise StoreError(f"metadata entry {k!r}: keys and values must be str (json.dumps other values)")
    return meta


def _dir_base(key: str) -> str:
    return f"{key}{SUFFIX_DIR}/"


def _manifest_name(key: str) -> str:
    return _dir_base(key) + MANIFEST_NAME


def key_of_name(name: str) -> str | None:
    """The logical key a stored name belongs to, or None for a non-artifact (a file inside a directory
    artifact, a directory without its manifest, a foreign object)."""
    if f"{SUFFIX_DIR}/" in name:
        head, tail = name.split(f"{SUFFIX_DIR}/", 1)
        return head if tail == MANIFEST_NAME and _is_key(head) else None
    for suffix in BLOB_SUFFIXES:
        if name.endswith(suffix) and _is_key(name[: -len(suffix)]):
            return name[: -len(suffix)]
    return None


def _is_key(text: str) -> bool:
    try:
        validate_key(text)
    except StoreError:
        return False
    return True


def _safe_relpath(rel: str, key: str) -> PurePosixPath:
    """A manifest path that stays inside the target folder (a tampered manifest must not escape it)."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise CorruptArtifactError(key, f"manifest lists unsafe path {rel!r}")
    return path


class ArtifactStore(ABC):
    """Backend-neutral API: backends only move named objects; this class owns format and integrity."""

    buffers_tables = True  # a table is serialised in memory before it is written (see _write_table)

    def __init__(self) -> None:
        self.quarantined: list[tuple[str, str]] = []

    # ---- backend primitives: names are relative posix paths such as "activations/ab12.arrow" ----

    @abstractmethod
    def describe(self) -> str:
        """Where the store lives, for messages and logs."""

    @abstractmethod
    def _write(self, name: str, data: bytes | memoryview, sha256: str, metadata: dict[str, str]) -> None:
        """Store ``data`` under ``name`` atomically: readers see the old object or the new one, whole."""

    @abstractmethod
    def _read(self, name: str) -> StoredObject | None:
        """The object's content and recorded checksum, or None if there is no such object."""

    def _read_mapped(self, name: str) -> StoredObject | None:
        """As _read, the content possibly a read-only view of the file mapped into memory (LocalStore): a table
        read that way is no private copy of its bytes. By default: _read."""
        return self._read(name)

    @abstractmethod
    def _read_info(self, name: str) -> StoredObject | None:
        """Checksum and metadata without the content (data is b""), or None if missing."""

    @abstractmethod
    def _names(self, prefix: str) -> list[str]:
        """Every stored name that starts with ``prefix``."""

    @abstractmethod
    def _remove(self, name: str) -> None:
        """Remove one object; a missing one is not an error."""

    @abstractmethod
    def _write_file(self, name: str, src: Path, sha256: str) -> None:
        """Upload a local file as one object, atomically."""

    @abstractmethod
    def _read_file(self, name: str, dest: Path) -> bool:
        """Download one object to ``dest``; False if there is no such object."""

    def _has(self, name: str) -> bool:
        return self._read_info(name) is not None

    # ---- public API ----

    def exists(self, key: str) -> bool:
        """True if an artifact of any kind is stored under ``key`` (a directory only once its manifest is)."""
        validate_key(key)
        return any(self._has(key + s) for s in BLOB_SUFFIXES) or self._has(_manifest_name(key))

    def put_bytes(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> None:
        """Store raw bytes (stored as ``<key>.bin``)."""
        self._put(key, SUFFIX_BYTES, bytes(data), metadata)

    def get_bytes(self, key: str) -> bytes:
        return self._get(key, SUFFIX_BYTES).data

    def put_json(self, key: str, obj: Any, metadata: Mapping[str, str] | None = None) -> None:
        """Store a JSON document (strict JSON: no NaN/inf; keys sorted so equal objects give equal bytes)."""
        try:
            text = json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"artifact {key}: value is not JSON-serialisable ({exc})") from exc
        self._put(key, SUFFIX_JSON, (text + "\n").encode("utf-8"), metadata)

    def get_json(self, key: str) -> Any:
        data = self._get(key, SUFFIX_JSON).data
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise StoreError(f"artifact {key} is not valid JSON ({exc})") from exc

    def put_table(self, key: str, table: pa.Table, metadata: Mapping[str, str] | None = None) -> None:
        """Store an Arrow table; ``metadata`` also goes into its schema metadata so it is self-describing."""
        validate_key(key)
        meta = _check_metadata(metadata)
        self._write_table(key + SUFFIX_TABLE, with_provenance(table, meta), meta)

    def _write_table(self, name: str, table: pa.Table, metadata: dict[str, str]) -> None:
        """Store a table as its Arrow IPC file's bytes, atomically; by default serialised in memory first (a
        backend that can write it straight into its object, LocalStore, needs no copy of the table's bytes)."""
        data = table_to_ipc_bytes(table)
        self._write(name, data, sha256_bytes(data), metadata)

    def get_table(self, key: str) -> pa.Table:
        """The stored table, checked against its sha256; a folder store's table lies in its file mapped into
        memory (a D1 task's layer of an 8B model at the full corpus is ~1.7 GB: read, not copied)."""
        data = self._get(key, SUFFIX_TABLE, mapped=True).data
        try:
            return ipc_bytes_to_table(data)
        except (pa.ArrowInvalid, OSError) as exc:
            raise StoreError(f"artifact {key} is not a readable Arrow IPC file ({exc})") from exc

    def get_metadata(self, key: str) -> dict[str, str]:
        """The metadata given when ``key`` was put, whatever its kind."""
        validate_key(key)
        for suffix in BLOB_SUFFIXES:
            info = self._read_info(key + suffix)
            if info is not None:
                return dict(info.metadata)
        return dict(self._load_manifest(key)["metadata"])

    def put_dir(
        self, key: str, local_dir: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
    ) -> None:
        """Store a directory (e.g. a saved HF model): files first, manifest last, so it exists only whole."""
        validate_key(key)
        meta = _check_metadata(metadata)
        files = iter_files(local_dir)
        if any(rel == MANIFEST_NAME for rel, _ in files):
            raise StoreError(f"{local_dir} has a top-level {MANIFEST_NAME}, which the store reserves")
        base = _dir_base(key)
        self._remove(base + MANIFEST_NAME)  # hide the old version before its files change
        entries = {}
        for rel, path in files:
            sha = sha256_file(path)
            self._write_file(base + rel, path, sha)
            entries[rel] = {"sha256": sha, "size": path.stat().st_size}
        for name in self._names(base):
            if name[len(base) :] not in entries:
                self._remove(name)
        manifest = {"format": MANIFEST_FORMAT, "files": entries, "metadata": meta}
        data = (json.dumps(manifest, sort_keys=True, indent=1) + "\n").encode("utf-8")
        self._write(base + MANIFEST_NAME, data, sha256_bytes(data), meta)

    def get_dir(self, key: str, local_dir: str | os.PathLike[str]) -> Path:
        """Fetch a directory artifact into ``local_dir`` (absent or empty), verifying every file's sha256;
        files land in a sibling staging folder renamed into place, so a failed fetch leaves nothing behind."""
        manifest = self._load_manifest(key)
        dest = Path(local_dir)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise StoreError(f"cannot fetch {key} into {dest}: it exists and is not an empty folder")
        base = _dir_base(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=dest.parent))
            os.chmod(staging, 0o755)
        except OSError as exc:
            raise StoreError(f"cannot create {dest}: {exc.strerror or exc}") from exc
        try:
            for rel, entry in manifest["files"].items():
                target = staging / _safe_relpath(rel, key)
                target.parent.mkdir(parents=True, exist_ok=True)
                if not self._read_file(base + rel, target):
                    raise CorruptArtifactError(key, f"incomplete: {rel} is missing from {self.describe()}")
                if sha256_file(target) != entry["sha256"]:
                    raise CorruptArtifactError(key, "sha256 mismatch", f"in file {rel}")
            if dest.exists():
                dest.rmdir()
            os.replace(staging, dest)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot fetch {key} into {dest}: {exc.strerror or exc}") from exc
            raise
        return dest

    def list(self, prefix: str = "") -> list[str]:
        """Sorted logical keys starting with ``prefix`` (a plain string prefix, e.g. "activations/")."""
        if not _PREFIX_RE.fullmatch(prefix):
            raise StoreError(f"invalid key prefix {prefix!r}: use [A-Za-z0-9_-] and '/'")
        keys = {key_of_name(name) for name in self._names(prefix)}
        return sorted(k for k in keys if k is not None and k.startswith(prefix))

    def delete(self, key: str) -> None:
        """Remove every object under ``key``; the manifest goes first so a directory vanishes at once."""
        validate_key(key)
        found = False
        for suffix in BLOB_SUFFIXES:
            if self._has(key + suffix):
                self._remove(key + suffix)
                found = True
        base = _dir_base(key)
        if self._has(base + MANIFEST_NAME):
            self._remove(base + MANIFEST_NAME)
            found = True
        for name in self._names(base):
            self._remove(name)
            found = True
        if not found:
            raise StoreError(f"artifact {key} not found in {self.describe()}")

    def check(self, key: str) -> str | None:
        """None when the artifact under ``key`` is stored and whole; otherwise why not, in a few words."""
        validate_key(key)
        try:
            if self._has(_manifest_name(key)):
                with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as tmp:
                    self.get_dir(key, Path(tmp) / "check")
                return None
            suffix = next((s for s in BLOB_SUFFIXES if self._has(key + s)), None)
            if suffix is None:
                return "missing"
            self._get(key, suffix)
        except CorruptArtifactError as exc:
            return exc.reason
        return None

    def intact(self, key: str) -> bool:
        """Stored and whole. A corrupt artifact is moved to quarantine/ (kept for inspection, out of the way of
        a recompute) and listed in ``self.quarantined``: a run recomputes it instead of stopping."""
        problem = self.check(key)
        if problem is None:
            return True
        if problem != "missing":
            self.quarantine(key, problem)
        return False

    def quarantine(self, key: str, reason: str) -> str:
        """Move every object of ``key`` under ``quarantine/<key>`` (with the reason in its metadata)."""
        target = f"{QUARANTINE_PREFIX}{key}"
        validate_key(target)
        base = _dir_base(key)
        names = [key + s for s in BLOB_SUFFIXES if self._has(key + s)] + self._names(base)
        for name in names:
            obj = self._read(name)
            if obj is None:
                continue
            meta = {**obj.metadata, "quarantined_because": reason}
            self._write(QUARANTINE_PREFIX + name, obj.data, sha256_bytes(obj.data), meta)
        if self._has(_manifest_name(key)):
            self._remove(_manifest_name(key))  # a directory vanishes at once, before its files go
        for name in names:
            self._remove(name)
        self.quarantined.append((key, reason))
        return target

    def verify(self, prefix: str = "", *, quarantine: bool = False) -> list[tuple[str, str]]:
        """(key, reason) for every artifact under ``prefix`` that is not whole; quarantined if asked."""
        bad = []
        for key in self.list(prefix):
            if key.startswith(QUARANTINE_PREFIX):
                continue
            problem = self.check(key)
            if problem is not None:
                bad.append((key, problem))
                if quarantine:
                    self.quarantine(key, problem)
        return bad

    # ---- shared plumbing ----

    def _put(self, key: str, suffix: str, data: bytes | memoryview, metadata: Mapping[str, str] | None) -> None:
        validate_key(key)
        self._write(key + suffix, data, sha256_bytes(data), _check_metadata(metadata))

    def _get(self, key: str, suffix: str, mapped: bool = False) -> StoredObject:
        validate_key(key)
        obj = self._read_mapped(key + suffix) if mapped else self._read(key + suffix)
        if obj is None:
            raise StoreError(self._missing_message(key, suffix))
        if obj.sha256 is None or sha256_bytes(obj.data) != obj.sha256:
            raise CorruptArtifactError(key, "sha256 mismatch", f"in {self.describe()}")
        return obj

    def _missing_message(self, key: str, suffix: str) -> str:
        others = [s for s in BLOB_SUFFIXES if s != suffix and self._has(key + s)]
        if suffix != SUFFIX_DIR and self._has(_manifest_name(key)):
            others.append(SUFFIX_DIR)
        where = self.describe()
        if others:
            kind, wanted = _KIND_NAMES[others[0]], _KIND_NAMES[suffix]
            return f"artifact {key} in {where} is stored as {kind}, not {wanted}"
        return f"artifact {key} not found in {where}"

    def _load_manifest(self, key: str) -> dict[str, Any]:
        try:
            manifest = json.loads(self._get_manifest_bytes(key).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            manifest = None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != MANIFEST_FORMAT
            or not isinstance(files, dict)
            or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str) for e in files.values())
        ):
            raise CorruptArtifactError(key, f"malformed {MANIFEST_NAME}")
        manifest.setdefault("metadata", {})
        return manifest

    def _get_manifest_bytes(self, key: str) -> bytes:
        validate_key(key)
        obj = self._read(_manifest_name(key))
        if obj is None:
            raise StoreError(self._missing_message(key, SUFFIX_DIR))
        if obj.sha256 is None or sha256_bytes(obj.data) != obj.sha256:
            raise CorruptArtifactError(key, "sha256 mismatch", f"in its {MANIFEST_NAME}")
        return obj.data
