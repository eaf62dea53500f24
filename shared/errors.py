"""One exception family, so the CLI can turn any boundary error into one line and a non-zero exit."""


class PoolBenchError(Exception):
    """A user-facing error: its message is one line that names the file, field, id or option at fault."""


class CorpusError(PoolBenchError):
    """A corpus file or record is missing or malformed."""


class StoreError(PoolBenchError):
    """The artifact store cannot be reached or an artifact is missing or corrupt."""


class StrategyError(PoolBenchError):
    """An unknown strategy id or a malformed strategy spec."""


class ModelLoadError(PoolBenchError):
    """A model id or path that cannot be loaded."""
