"""Local-folder backend of the artifact store: each object beside a checksum sidecar written just before it, every
file renamed into place whole, so a failed write leaves nothing visible."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import pyarrow as pa

from poolbench.atomic_write import atomic_file, atomic_path
from poolbench.errors import StoreError
from poolbench.store.arrow_tables import map_file, write_ipc_file
from poolbench.store.artifact_store import BLOB_SUFFIXES, SUFFIX_DIR, TMP_PREFIX, ArtifactStore, StoredObject
from poolbench.store.keys import sha256_file, validate_key

SIDECAR_SUFFIX = ".poolbench-meta.json"
LOCAL_PREFIX = "local:"  # how describe() names a folder store (made absolute); results.json records it



def _atomic_write(path: Path, fill: Callable[[IO[bytes]], None]) -> None:
    with atomic_file(path, prefix=TMP_PREFIX) as fh:
        fill(fh)



class LocalStore(ArtifactStore):
    """Artifacts in a local folder. Each object has a checksum sidecar written just before it; the object's
    rename is the commit point, so a failed first write leaves nothing visible, and a failed rewrite puts
    the old sidecar back. A hard crash inside a rewrite of different bytes reads as corrupt, never as
    wrong data (keys are content-determined, so rewrites normally carry the same bytes anyway)."""

    buffers_tables = False  # written straight into their files (_write_table)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root).expanduser().absolute()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store folder {self.root}: {exc.strerror or exc}") from exc

    def describe(self) -> str:
        return f"{LOCAL_PREFIX}{self.root}"

    def stored_bytes(self, keys: Iterable[str]) -> int:
        """The bytes these keys' blobs take on disk, sidecars included (0 for a key not stored): what a run's
        room in this folder is spent on (driver.room_gate)."""
        total = 0
        for key in keys:
            for suffix in BLOB_SUFFIXES:
                path = self._path(validate_key(key) + suffix)
                for file in (path, self._sidecar(path)):
                    with contextlib.suppress(FileNotFoundError):
                        total += file.stat().st_size
        return total

    def _path(self, name: str) -> Path:
        return self.root / name

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_name(path.name + SIDECAR_SUFFIX)

    def _write(self, name: str, data: bytes | memoryview, sha256: str, metadata: dict[str, str]) -> None:
        def fill(tmp: Path) -> str:
            with open(tmp, "wb") as fh:
                fh.write(data)
            return sha256

        self._commit(name, metadata, fill)

    def _write_table(self, name: str, table: pa.Table, metadata: dict[str, str]) -> None:
        """Straight into the object's file, hashed from the page cache after: no serialised copy of the table in
        memory (a layer's shard of an 8B model is GBs, and an extractor writes several at once: host_room.py)."""
        def fill(tmp: Path) -> str:
            write_ipc_file(table, tmp)
            return sha256_file(tmp)

        self._commit(name, metadata, fill)

    def _commit(self, name: str, metadata: dict[str, str], fill: Callable[[Path], str]) -> None:
        """Store an object atomically: `fill` writes its temp file and returns its sha256, the sidecar is written
        next, the temp file renamed into place last (the commit point); a failure after the sidecar puts the old
        one back (or removes it), and one before leaves everything as it was."""
        path = self._path(name)
        sidecar = self._sidecar(path)
        try:
            old_info = sidecar.read_bytes() if path.exists() else None
        except OSError:
            old_info = None
        sidecar_written = False
        try:
            with atomic_path(path, prefix=TMP_PREFIX) as tmp:
                info = json.dumps({"sha256": fill(tmp), "metadata": metadata}, sort_keys=True).encode("utf-8")
                _atomic_write(sidecar, lambda f: f.write(info))
                sidecar_written = True
        except BaseException as exc:
            if sidecar_written:
                with contextlib.suppress(OSError):
                    if old_info is None:
                        sidecar.unlink()
                    else:
                        _atomic_write(sidecar, lambda f: f.write(old_info))
            if isinstance(exc, OSError):
                raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
            raise

    def _info(self, path: Path) -> tuple[str | None, dict[str, str]]:
        try:
            info = json.loads(self._sidecar(path).read_text("utf-8"))
            return str(info["sha256"]), dict(info.get("metadata") or {})
        except (OSError, ValueError, KeyError, TypeError):
            return None, {}

    def _read(self, name: str) -> StoredObject | None:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
        sha, meta = self._info(path)
        return StoredObject(data, sha, meta)

    def _read_mapped(self, name: str) -> StoredObject | None:
        """The object's file mapped read-only into memory: its pages are the OS's file cache, shared, never a
        private copy. Safe because a stored file is never changed in place (a write renames a new file over it, a
        delete unlinks it: a mapping keeps the file it opened)."""
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            data = map_file(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        sha, meta = self._info(path)
        return StoredObject(data, sha, meta)

    def _read_info(self, name: str) -> StoredObject | None:
        path = self._path(name)
        if not path.is_file():
            return None
        sha, meta = self._info(path)
        return StoredObject(b"", sha, meta)

    def _has(self, name: str) -> bool:
        return self._path(name).is_file()

    def _names(self, prefix: str) -> list[str]:
        start = self.root / prefix.rpartition("/")[0]
        names = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_PREFIX)]
            rel_dir = Path(dirpath).relative_to(self.root)
            for fname in filenames:
                if fname.startswith(TMP_PREFIX) or fname.endswith(SIDECAR_SUFFIX):
                    continue
                name = (rel_dir / fname).as_posix()
                if name.startswith(prefix):
                    names.append(name)
        return names

    def _remove(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink(missing_ok=True)
            self._sidecar(path).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc.strerror or exc}") from exc
        parent = path.parent
        while parent != self.root and f"{SUFFIX_DIR}/" in parent.relative_to(self.root).as_posix() + "/":
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def _write_file(self, name: str, src: Path, sha256: str) -> None:
        path = self._path(name)
        try:
            with open(src, "rb") as fsrc:
                _atomic_write(path, lambda f: shutil.copyfileobj(fsrc, f, 1 << 20))
        except OSError as exc:
            raise StoreError(f"cannot copy {src} to {path}: {exc.strerror or exc}") from exc

    def _read_file(self, name: str, dest: Path) -> bool:
        path = self._path(name)
        try:
            shutil.copyfile(path, dest)
        except FileNotFoundError:
            if path.exists():
                raise StoreError(f"cannot write {dest}") from None
            return False
        except OSError as exc:
            raise StoreError(f"cannot copy {path} to {dest}: {exc.strerror or exc}") from exc
        return True
