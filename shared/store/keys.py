"""Deterministic artifact keys: equal determinants name the same artifact, any change names a new one.

A key is an extension-less logical name ``<kind>/<hash>`` where ``<hash>`` is the first 32 hex digits
of the sha256 of the canonical JSON of the determinants (sorted keys, no whitespace, floats by ``repr``,
strict JSON: no NaN/inf). Key segments are ``[A-Za-z0-9][A-Za-z0-9_-]*`` joined by ``/``: no dots,
so the store's storage suffixes (``.arrow``, ``.json``, ``.bin``, ``.dir/``) can never clash with a key.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from poolbench.atomic_write import write_json_atomic
from poolbench.errors import StoreError

KEY_HASH_CHARS = 32
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9_-]*"
_KEY_RE = re.compile(rf"{_SEGMENT}(/{_SEGMENT})*")
_CHUNK = 1 << 20


def validate_key(key: str) -> str:
    """Return ``key`` unchanged, or raise StoreError if it is not a safe logical key."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise StoreError(
            f"invalid artifact key {key!r}: use '/'-separated segments of [A-Za-z0-9_-] "
            "(no dots, no leading '/')"
        )
    return key


def _jsonable(value: Any, where: str) -> Any:
    """Reduce a determinant to plain JSON types so its canonical form does not depend on Python types."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise StoreError(f"determinant {where} is {value!r}: NaN/inf cannot name an artifact")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise StoreError(f"determinant {where} has a non-string key {k!r}")
            out[k] = _jsonable(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "model_dump"):
        return _jsonable(value.model_dump(mode="json"), where)
    raise StoreError(
        f"determinant {where} has type {type(value).__name__}: use str/int/float/bool/None/list/dict "
        "(hash files and paths first)"
    )


def canonical_json(obj: Any) -> str:
    """The one JSON spelling of ``obj``: sorted keys, no whitespace, floats by repr, ASCII only."""
    return json.dumps(
        _jsonable(obj, "value"), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def artifact_key(kind: str, **determinants: Any) -> str:
    """Name the artifact of ``kind`` fully determined by ``determinants`` (model hash, layers, seed, ...)."""
    validate_key(kind)
    if not determinants:
        raise StoreError(f"artifact_key({kind!r}) needs at least one determinant")
    payload = {k: _jsonable(v, k) for k, v in determinants.items()}
    digest = hashlib.sha256(canonical_json(payload).encode("ascii")).hexdigest()
    return f"{kind}/{digest[:KEY_HASH_CHARS]}"


def layer_shard_key(key: str, layer: int) -> str:
    """The key of one layer's shard of a per-concept artifact: a reader of one layer never opens the others."""
    validate_key(key)
    return artifact_key(key.split("/", 1)[0], of=key, layer=int(layer))


def sha256_bytes(data: bytes | memoryview) -> str:
    """Hex sha256 of an in-memory payload."""
    return hashlib.sha256(data).hexdigest()


def cached_sha256(files: Sequence[Path], sidecar: Path) -> str:
    """sha256 over the files' bytes in the given order, remembered in a JSON sidecar keyed by each file's name,
    size and mtime, so multi-GB weights hash once; where the sidecar cannot be written, the next call hashes again."""
    key = [[f.name, (st := f.stat()).st_size, st.st_mtime_ns] for f in files]
    try:
        cached = json.loads(sidecar.read_text())
        if cached.get("files") == key:
            return str(cached["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    sha = h.hexdigest()
    with contextlib.suppress(OSError):
        write_json_atomic(sidecar, {"files": key, "sha256": sha})
    return sha


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in chunks so multi-GB weight files do not load into memory."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise StoreError(f"cannot hash {path}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def iter_files(root: str | os.PathLike[str]) -> list[tuple[str, Path]]:
    """Every regular file under ``root`` (symlinks followed) as sorted (posix relative path, path) pairs."""
    base = Path(root)
    if not base.is_dir():
        raise StoreError(f"{base} is not a directory")
    found = []
    for dirpath, _dirnames, filenames in os.walk(base, followlinks=True):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file():
                found.append((path.relative_to(base).as_posix(), path))
    return sorted(found)


def hash_directory(path: str | os.PathLike[str], patterns: Iterable[str] = ("*",)) -> str:
    """Stable hex sha256 of the files under ``path`` matching any glob in ``patterns`` (matched on the
    posix relative path): independent of mtimes and walk order, so a model dir hashes the same anywhere."""
    pats = list(patterns)
    listing = {
        rel: sha256_file(p)
        for rel, p in iter_files(path)
        if any(fnmatch.fnmatchcase(rel, pat) for pat in pats)
    }
    if not listing:
        raise StoreError(f"no files matching {pats} under {path}")
    return hashlib.sha256(canonical_json(listing).encode("ascii")).hexdigest()
