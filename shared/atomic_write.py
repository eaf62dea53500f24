"""Files written whole or not at all: a reader (or a crash) sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); platforms without directory fds just skip it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, *, prefix: str | None = None, mode: int = 0o644) -> Iterator[Path]:
    """The path of a temp file whose contents replace `path` only if the block finishes (in the same folder,
    fsync, os.replace, fsync of the folder), for a writer that opens the file itself (Arrow's native file); an
    exception leaves `path` as it was and no temp behind. The block must have closed the file when it ends."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix or f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path, *, prefix: str | None = None, mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A binary file handle whose contents replace `path` only if the block finishes (atomic_path)."""
    with atomic_path(path, prefix=prefix, mode=mode) as tmp, open(tmp, "wb") as fh:
        yield fh


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_file(path) as fh:
        fh.write(text.encode("utf-8"))


def write_json_atomic(path: Path, obj: object) -> None:
    """JSON a person reads (results.json, leaderboard.json); NaN is refused, not written."""
    write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")
