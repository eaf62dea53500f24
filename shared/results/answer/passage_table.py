"""The run folder's copy of every D1 cell's per-passage scores (passage_scores.arrow, Arrow IPC), beside
results.json: the answer, `--log-samples` and the report read it; the store keeps the same table per concept."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from poolbench.atomic_write import atomic_file
from poolbench.errors import PoolBenchError
from poolbench.prober.passage_scores import PASSAGE_SCORES_SCHEMA
from poolbench.store.arrow_tables import ipc_bytes_to_table

RUN_SCORES_FILE = "passage_scores.arrow"


def write_run_scores(table: pa.Table, run_dir: Path) -> Path:
    """Write the table atomically into the run folder and return its path."""
    path = run_dir / RUN_SCORES_FILE
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)  # zstd: the repeated strings shrink; the float scores do not
    with atomic_file(path) as fh:
        fh.write(sink.getvalue().to_pybytes())
    return path


def read_run_scores(run_dir: Path) -> pa.Table | None:
    """The run folder's per-passage scores, or None for a run written before they were kept; a damaged file or one
    without the schema's columns stops in one line naming it."""
    path = run_dir / RUN_SCORES_FILE
    if not path.is_file():
        return None
    try:
        table = ipc_bytes_to_table(path.read_bytes())
    except (OSError, pa.ArrowInvalid) as exc:
        raise PoolBenchError(f"{path}: not an Arrow IPC file ({exc})") from None
    missing = [n for n in PASSAGE_SCORES_SCHEMA.names if n not in table.column_names]
    if missing:
        raise PoolBenchError(f"{path}: lacks column(s) {', '.join(missing)}")
    return table
