"""One exception family, so the CLI can turn any boundary error into one line and a non-zero exit."""

import re

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""Colour codes inside the remote tracebacks Ray forwards: removed before a message is cut to its first line."""


def without_colours(text: str) -> str:
    """`text` with terminal colour codes removed."""
    return ANSI.sub("", text)


class PoolBenchError(Exception):
    """A user-facing error: its message is one line that names the file, field, id or option at fault."""


class CorpusError(PoolBenchError):
    """A corpus file or record is missing or malformed."""


class StoreError(PoolBenchError):
    """The artifact store cannot be reached or an artifact is missing or corrupt."""


class CorruptArtifactError(StoreError):
    """An artifact's bytes do not match its recorded sha256 (or its manifest is malformed): never read as data."""

    def __init__(self, key: str, reason: str, where: str = "") -> None:
        super().__init__(f"artifact {key} is corrupt ({reason})" + (f" {where}" if where else ""))
        self.key, self.reason = key, f"{reason} {where}".strip()


class StrategyError(PoolBenchError):
    """An unknown strategy id or a malformed strategy spec."""


class ModelLoadError(PoolBenchError):
    """A model id or path that cannot be loaded."""


class StageFailed(PoolBenchError):
    """A later stage of a run failed after the earlier ones' results were written (they stand; the run exits 1)."""


class ExtractionError(PoolBenchError):
    """A tokenizer or model that extraction cannot work with."""
