"""pyarrow's own IPC file bytes of a table: what the store's writers are held to, byte for byte."""

from __future__ import annotations

import pyarrow as pa


def library_ipc_bytes(table: pa.Table) -> bytes:
    """pyarrow's own way: a growing output stream, its buffer copied out."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
