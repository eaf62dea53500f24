"""Arrow IPC (file format) bytes for tables, provenance in the schema metadata: a table describes itself."""

from __future__ import annotations

import os
from collections.abc import Mapping

import pyarrow as pa


def with_provenance(table: pa.Table, metadata: Mapping[str, str]) -> pa.Table:
    """Return ``table`` with ``metadata`` merged into its schema metadata (new entries win)."""
    if not metadata:
        return table
    merged = dict(table.schema.metadata or {})
    merged.update({k.encode("utf-8"): v.encode("utf-8") for k, v in metadata.items()})
    return table.replace_schema_metadata(merged)


def schema_metadata(table: pa.Table) -> dict[str, str]:
    """The table's schema metadata decoded to str (non-UTF-8 entries, e.g. foreign binary, are skipped)."""
    out = {}
    for k, v in (table.schema.metadata or {}).items():
        try:
            out[k.decode("utf-8")] = v.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def table_to_ipc_bytes(table: pa.Table) -> memoryview:
    """Serialise a table to the Arrow IPC file format (random-access, readable by any Arrow library), as a
    read-only view of one buffer. The buffer is sized exactly first (a counting pass that copies nothing), so
    the table's bytes are copied once: a growing output stream copied a 1 GB shard several times over, and a
    bytes object once more (bench/shard_writes.py)."""
    counted = pa.MockOutputStream()
    with pa.ipc.new_file(counted, table.schema) as writer:
        writer.write_table(table)
    buffer = pa.allocate_buffer(counted.size())
    with pa.ipc.new_file(pa.FixedSizeBufferWriter(buffer), table.schema) as writer:
        writer.write_table(table)
    return memoryview(buffer).toreadonly()


def write_ipc_file(table: pa.Table, path: str | os.PathLike[str]) -> None:
    """Serialise a table in the Arrow IPC file format straight into a file (Arrow's native writes from the table's
    own buffers): the bytes table_to_ipc_bytes makes, with no copy of them in memory."""
    with pa.OSFile(os.fspath(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def map_file(path: str | os.PathLike[str]) -> memoryview:
    """A file's bytes mapped read-only into memory: the OS's file cache, shared, never a private copy; the mapping
    outlives the call (and an unlink of the file). OSError as pyarrow raises it when the file cannot be mapped."""
    mapped = pa.memory_map(os.fspath(path))
    try:
        return memoryview(mapped.read_buffer())  # the buffer keeps the mapping alive after close
    finally:
        mapped.close()


def ipc_bytes_to_table(data: bytes | memoryview) -> pa.Table:
    """Read a table written by :func:`table_to_ipc_bytes`."""
    with pa.ipc.open_file(pa.BufferReader(data)) as reader:
        return reader.read_all()
