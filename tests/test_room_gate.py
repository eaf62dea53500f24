"""--drop-pooled's pieces on their own: the room gate (pooling jobs start while the vectors in the store fit the
room at the files' measured size, in concept order, each drop letting the next start), a folder store's bytes on
disk, and the drop (every artifact a concept's pooling stored,
the manifest first and each shard before its companions, another concept's left alone)."""

from __future__ import annotations

import pyarrow as pa

from poolbench.driver.room_gate import RoomGate
from poolbench.pooler.gradient_sums import gradient_table_key
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.learned import learned_table_key
from poolbench.pooler.pooled_drop import drop_pooled, pooled_keys
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore


def test_without_a_room_every_job_starts_in_order() -> None:
    gate: RoomGate[str] = RoomGate(None)
    assert [job for name in "abc" for job in gate.admit({name: 10**12}, name)] == ["a", "b", "c"]
    assert gate.waiting == 0


class Disk:
    """A disk whose room the test sets as files land and leave."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __call__(self) -> int:
        return self.room


def test_one_concept_runs_until_one_was_pooled_and_probed_then_jobs_start_within_the_disks_room() -> None:
    """Each admitted concept holds room for its vector files until written and for its D1 files until its vectors
    leave, at the largest ratios to its count measured so far; the room is the disk's, read at each decision."""
    disk = Disk(100)
    gate: RoomGate[str] = RoomGate(disk)
    assert gate.admit({"a": 40}, "a") == ["a"]
    assert gate.admit({"b": 40}, "b") == []  # what a counted byte takes on disk is not known yet
    disk.room -= 40
    assert gate.measured("a", 40) == []  # a's vector files: 1.0 a counted byte; what its probes write, unknown
    disk.room += 40 - 10  # a's vectors leave, its D1 files (10) stay
    assert gate.dropped("a", 10) == ["b"]  # 40 x 1.0 + 40 x 0.25 <= 90
    assert gate.admit({"c": 30}, "c") == ["c"]  # (40 + 30) x 1.0 + (40 + 30) x 0.25 = 87.5 <= 90
    assert gate.admit({"d": 20}, "d") == []  # 90 x 1.25 > 90
    disk.room -= 50
    assert gate.measured("b", 50) == []  # 1.25 a counted byte: (30 + 20) x 1.25 + 90 x 0.25 > 40
    assert gate.admit({"e": 1}, "e") == []  # behind d, though it would fit: the concepts' order is kept
    disk.room += 50 - 20
    assert gate.dropped("b", 20) == []  # D1 now 0.5 a counted byte: 50 x 1.25 + 50 x 0.5 > 70
    assert (gate.scale, gate.d1_scale) == (1.25, 0.5)
    disk.room -= 30
    assert gate.measured("c", 30) == []  # 20 x 1.25 + 50 x 0.5 > 40; the largest ratio stands (c's: 1.0)
    assert gate.waiting == 2 and gate.unwritten == {}
    disk.room += 30 - 15
    assert gate.dropped("c", 15) == ["d", "e"]  # nothing admitted in the store: d; then 21 x 1.25 + 21 x 0.5 <= 55
    assert gate.counted == {"d": 20, "e": 1} == gate.unwritten


def test_a_job_larger_than_the_room_starts_when_no_admitted_concept_is_in_the_store() -> None:
    disk = Disk(100)
    gate: RoomGate[str] = RoomGate(disk)
    assert gate.admit({"big": 150}, "big") == ["big"]
    disk.room = 0
    assert gate.measured("big", 150) == []
    assert gate.admit({"next": 1}, "next") == []
    assert gate.dropped("big", 30) == ["next"]  # the room is not read: nothing admitted is in the store


def test_a_concepts_passes_add_up_and_leave_together_and_a_concept_never_admitted_frees_nothing() -> None:
    disk = Disk(100)
    gate: RoomGate[str] = RoomGate(disk)
    gate.scale, gate.d1_scale = 1.0, 0.0  # as a first concept pooled and probed would leave them
    assert gate.admit({"a": 30}, "a layers 0-2") == ["a layers 0-2"]
    assert gate.admit({"a": 30}, "a layer 3") == ["a layer 3"]  # 60 of 100
    disk.room -= 60
    assert gate.measured("a", 60) == []  # both passes' files against both passes' count
    assert gate.admit({"b": 30, "c": 20}, "b+c") == []  # a group: 50 > 40
    assert gate.dropped("pooled-by-an-earlier-run", 99) == [] and gate.d1_scale == 0.0
    assert gate.counted == {"a": 60} and gate.scale == 1.0
    disk.room += 60
    assert gate.dropped("a") == ["b+c"] and gate.counted == {"b": 30, "c": 20}


def test_the_first_concepts_passes_start_together_and_a_forced_job_starts_whatever_the_room() -> None:
    disk = Disk(100)
    gate: RoomGate[str] = RoomGate(disk)
    assert gate.admit({"a": 30}, "a layer 0") == ["a layer 0"]
    assert gate.admit({"a": 30}, "a layer 1") == ["a layer 1"]  # its D1 needs both: no ratio is known before it
    assert gate.admit({"b": 30}, "b layer 0") == []
    assert gate.admit({"b": 30}, "b layer 1") == []
    disk.room = 0
    assert gate.force() == ["b layer 0"] and gate.counted == {"a": 60, "b": 30}
    assert gate.force() == ["b layer 1"] and gate.force() == [] and gate.waiting == 0


def stored_concept(store: LocalStore, key: str, layers: list[int]) -> None:
    """What a concept's pooling stores with S2 and S3 (and a learned aggregator): per layer the PooledTable shard,
    its head, learned-fit and gradient-sum tables; then the manifest."""
    table = pa.table({"v": pa.array([1.0, 2.0], pa.float32())})
    for layer in layers:
        shard = layer_shard_key(key, layer)
        for companion in (head_table_key(shard), learned_table_key(shard), gradient_table_key(shard), shard):
            store.put_table(companion, table)
    store.put_json(key, {"layers": layers})


def test_a_drop_takes_every_artifact_of_the_concepts_pooling_in_order_and_leaves_the_others(tmp_path,
                                                                                           monkeypatch) -> None:
    store = LocalStore(tmp_path / "store")
    stored_concept(store, "pooled/aaaa", [0, 5])
    stored_concept(store, "pooled/bbbb", [0, 5])
    before = set(store.list(""))
    deleted: list[str] = []
    real = store.delete
    monkeypatch.setattr(store, "delete", lambda key: (deleted.append(key), real(key)))
    assert drop_pooled(store, "pooled/aaaa", [0, 5]) == 9  # the manifest, and four tables at each of two layers
    shard0, shard5 = layer_shard_key("pooled/aaaa", 0), layer_shard_key("pooled/aaaa", 5)
    assert deleted == ["pooled/aaaa",
                       shard0, head_table_key(shard0), learned_table_key(shard0), gradient_table_key(shard0),
                       shard5, head_table_key(shard5), learned_table_key(shard5), gradient_table_key(shard5)]
    assert deleted == pooled_keys("pooled/aaaa", [0, 5])
    assert set(store.list("")) == before - set(deleted) and len(before) == 2 * len(deleted)
    assert all(store.exists(key) for key in pooled_keys("pooled/bbbb", [0, 5]))
    assert drop_pooled(store, "pooled/aaaa", [0, 5]) == 0  # a second drop (a resumed run's) finds nothing


def test_a_folder_stores_bytes_of_keys_are_its_files_and_sidecars(tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    stored_concept(store, "pooled/aaaa", [0])
    keys = pooled_keys("pooled/aaaa", [0])
    files = [path for path in (tmp_path / "store").rglob("*") if path.is_file()]
    assert len(files) == 2 * 5  # the manifest and four tables, each with its sidecar
    assert store.stored_bytes(keys) == sum(path.stat().st_size for path in files)
    assert store.stored_bytes([*keys, "pooled/not-there"]) == store.stored_bytes(keys)
    assert store.stored_bytes(keys[1:]) < store.stored_bytes(keys)
