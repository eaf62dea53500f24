"""An S3 store's tables through a spool file, against a real S3 server: a large table uploaded in parts from its
spool, a spool that cannot take the table or fails midway (written and read through memory, said once), and a
read-back that lies in its mapped spool file."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from arrow_bytes import library_ipc_bytes
from s3_server import s3_store_on

from poolbench.errors import StoreError
from poolbench.store.s3 import S3Store

KEY = "pooled/0123abcd"


@pytest.fixture
def spooled_s3(moto_s3, tmp_path: Path) -> tuple[S3Store, Path]:
    """An S3 store on a fresh bucket spooling into a folder of its own (the system's is shared with whatever else
    runs), and that folder."""
    spool = tmp_path / "spool"
    spool.mkdir()
    store = s3_store_on(moto_s3)
    store.spool_dir = str(spool)
    return store, spool


def test_an_s3_table_over_a_part_goes_up_in_parts_from_its_spool_and_reads_back_whole(spooled_s3,
                                                                                       monkeypatch) -> None:
    """A 13 MB table (minio's parts are 5 MiB at least) is uploaded from its spool file in three parts (S3 names a
    multipart object's ETag "<md5 of the parts' md5s>-<parts>"), the spool is gone after, and the object is the
    library's bytes with their sha256."""
    from poolbench.store import artifact_store as base
    from poolbench.store.arrow_tables import with_provenance

    store, spool = spooled_s3
    monkeypatch.setattr(base, "table_to_ipc_bytes", lambda t: pytest.fail("serialised in memory"))
    values = np.arange(13 * 2**20 // 4, dtype=np.float32) / 7
    table = pa.table({"v": pa.FixedSizeListArray.from_arrays(pa.array(values), 1024)})
    store.put_table(KEY, table, metadata={"layer": "5"})
    want = library_ipc_bytes(with_provenance(table, {"layer": "5"}))
    stat = store._client.stat_object(store.bucket, store._object(f"{KEY}.arrow"))
    assert stat.size == len(want) > 2 * 5 * 2**20 and stat.etag.endswith("-3"), (stat.size, stat.etag)
    assert stat.content_type == "application/vnd.apache.arrow.file"
    assert list(spool.iterdir()) == []
    stored = store._read(f"{KEY}.arrow")
    assert stored is not None and bytes(stored.data) == want and stored.sha256 == hashlib.sha256(want).hexdigest()
    assert store.get_table(KEY).equals(with_provenance(table, {"layer": "5"}))


def test_an_s3_store_whose_spool_cannot_take_a_table_writes_it_from_memory_and_says_so(moto_s3, tmp_path,
                                                                                      caplog) -> None:
    """A spool that is not a folder (full or unwritable likewise): the table is serialised in memory as before,
    stored whole with its sha256, and the log says once where the spool failed."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    store = s3_store_on(moto_s3)
    store.spool_dir = str(not_a_folder)
    table = pa.table({"v": pa.array([1.5, -2.0], pa.float32())})
    with caplog.at_level(logging.WARNING, logger="poolbench.store.s3"):
        store.put_table(KEY, table)
        store.put_table(KEY + "-2", table)
    assert store.get_table(KEY).column("v").to_pylist() == [1.5, -2.0]
    assert store.get_table(KEY + "-2").num_rows == 2
    said = [r.getMessage() for r in caplog.records if "could not spool" in r.getMessage()]
    assert len(said) == 1 and str(not_a_folder) in said[0] and "through memory" in said[0]


def test_an_s3_spool_that_fails_midway_leaves_the_table_written_and_read_through_memory(spooled_s3, monkeypatch,
                                                                                          caplog) -> None:
    """A spool folder made but its file not written or mapped (a full disk): the write serialises the table in
    memory, the read takes the object whole, both after the spool folder is gone; the log says so once."""
    import errno

    from poolbench.store import s3

    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    store, spool = spooled_s3
    monkeypatch.setattr(s3, "write_ipc_file", full)
    monkeypatch.setattr(s3, "map_file", full)
    table = pa.table({"v": pa.array([0.5, 4.0], pa.float32())})
    with caplog.at_level(logging.WARNING, logger="poolbench.store.s3"):
        store.put_table(KEY, table)
        assert store.get_table(KEY).column("v").to_pylist() == [0.5, 4.0]
    assert list(spool.iterdir()) == []
    said = [r.getMessage() for r in caplog.records if "could not spool" in r.getMessage()]
    assert len(said) == 1 and "No space left" in said[0]


def test_an_s3_tables_bytes_lie_in_its_spool_file_mapped_into_memory(spooled_s3) -> None:
    """Read back, an S3 table lies in a mapping of its downloaded spool file, not in a private copy (a D1 task's
    layer is ~1.7 GB); the file is unlinked at once (its name gone, the mapping keeping it), and a missing key is
    still "not found"."""
    store, spool = spooled_s3
    table = pa.table({"v": pa.array(range(1 << 16), pa.float64())})
    store.put_table("t/a", table)
    got = store.get_table("t/a")
    assert got.equals(table) and list(spool.iterdir()) == []
    address = got.column("v").chunks[0].buffers()[1].address
    spans = [line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines()
             if str(spool) in line and line.endswith("(deleted)")]
    assert any(int(low, 16) <= address < int(high, 16) for low, high in spans)
    with pytest.raises(StoreError, match="not found"):
        store.get_table("t/missing")
