"""The store's room for a run's pooling: the vector bytes counted before any forward equal what pooling stores,
and a folder store too small for them stops the run first with one line; with --drop-pooled the largest concept
must fit the room the pooling may fill, not the sum."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from negation_pairs import passages

from poolbench.byte_size import size
from poolbench.driver.run_plan import ConceptPlan
from poolbench.driver.store_room import ROOM_SHARE, check_store_room, pooling_bytes, pooling_room
from poolbench.errors import StoreError
from poolbench.pooler.gradient_sums import gradient_table_key
from poolbench.pooler.iti import head_table_key
from poolbench.pooler.learned import learned_table_key
from poolbench.pooler.registry import resolve_strategies
from poolbench.pooler.stored_size import vector_bytes_per_passage_layer
from poolbench.pooler.worker import ExtractorWorker
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore
from poolbench.store.s3 import S3Store


def vector_payload(table: pa.Table) -> int:
    """Bytes of the table's fixed-size-list columns' values: the vectors a store holds, without ids or framing."""
    return sum(column.combine_chunks().values.nbytes for column in table.columns
               if pa.types.is_fixed_size_list(column.type))


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_the_count_before_pooling_is_the_vector_bytes_pooling_stores(tiny_llama_dir, tmp_path, store_dtype) -> None:
    """Every object of a pooled concept (PooledTable, S3's heads, S2's gradient sums, a learned aggregator's fits),
    its vector columns' bytes summed, is the worker's per-passage-and-layer count times passages times layers."""
    strategies = ["A1_mean", "P1_last", "S2_gradient", "S3_iti_probe", "LA2_softmax_probe"]
    worker = ExtractorWorker(str(tiny_llama_dir))
    data = passages(8, "train") + passages(4, "test")
    store = LocalStore(tmp_path / "store")
    worker.pool_concept("negation", data, [0, 1], strategies, store_url=str(tmp_path / "store"), key="pooled/k",
                        metadata={"concept": "negation"}, batch_size=8, max_length=48, store_dtype=store_dtype)
    stored = 0
    for layer in (0, 1):
        shard = layer_shard_key("pooled/k", layer)
        for key in (shard, head_table_key(shard), gradient_table_key(shard), learned_table_key(shard)):
            stored += vector_payload(store.get_table(key))
    count = worker.stored_bytes_per_passage_layer(strategies, store_dtype)
    assert count * len(data) * 2 == stored
    # By hand for this model (d 32, 2 heads of 16): 5 rows, 2 heads' vectors and outputs, a gradient sum, 6 fits.
    width = 4 if store_dtype == "float32" else 2
    assert count == 5 * 32 * width + 2 * (32 * width + 16 * 4) + 32 * 4 + 6 * 32 * 4


def test_the_full_benchmark_at_d_4096_is_about_ten_gigabytes_a_concept() -> None:
    """The 19 card strategies on an 8B shape (32 heads of 128) at 6 layers and 2,000 passages: S3's head vectors
    are 32 of the 51 d-vectors a passage and layer; a 16-bit store halves all but the heads' own outputs."""
    specs = resolve_strategies(None)
    f32 = vector_bytes_per_passage_layer(specs, 4096, 32, 128, "float32")
    bf16 = vector_bytes_per_passage_layer(specs, 4096, 32, 128, "bfloat16")
    assert f32 == (19 + 32 + 1) * 4096 * 4 + 32 * 128 * 4  # rows, heads, S2's gradient sum; the heads' outputs
    assert bf16 == (19 + 32) * 4096 * 2 + 4096 * 4 + 32 * 128 * 4
    assert round(f32 * 2000 * 6 / 1e9, 2) == 10.42 and round(bf16 * 2000 * 6 / 1e9, 2) == 5.41


def plans(n: int, passages_each: int) -> list[tuple[ConceptPlan, list[int]]]:
    return [(ConceptPlan(f"c{i}", passages(passages_each // 2, "train"), f"h{i}"), [0, 3, 5]) for i in range(n)]


def test_a_folder_store_without_room_stops_the_run_before_pooling(tmp_path) -> None:
    """Lower bound against the disk's free bytes: more than free stops with one line (the store, the bytes, the way
    out); as much as free passes; nothing left to pool or an S3 store asks nothing."""
    store = LocalStore(tmp_path / "s")
    to_pool = plans(3, 20)
    assert pooling_bytes(to_pool, 1000) == 1000 * 3 * 20 * 3
    asked: list[int] = []

    def per_passage_layer() -> int:
        asked.append(1)
        return 1000

    assert check_store_room(store, to_pool, per_passage_layer, "float32", free_bytes=lambda _: 180_000) == 180_000
    with pytest.raises(StoreError) as err:
        check_store_room(store, to_pool, per_passage_layer, "float32", free_bytes=lambda _: 179_999)
    message = str(err.value)
    assert "\n" not in message and f"store local:{store.root}" in message
    assert "(3 concepts, 60 passages) needs at least 0.2 MB and its disk has 0.2 MB free" in message
    assert "--store-dtype bfloat16" in message and "fewer --layers" in message
    assert "--drop-pooled (each concept's vectors leave the store once its D1 is stored; with --no-steering)" \
        in message
    assert [size(n) for n in (99_999, 100_000, 2_345_678, 99_999_999, 10_423_000_000)] == \
        ["99999 bytes", "0.1 MB", "2.3 MB", "100.0 MB", "10.4 GB"]
    with pytest.raises(StoreError, match=r"free: use --drop-pooled \(.*\), fewer --layers") as err:
        check_store_room(store, to_pool, per_passage_layer, "bfloat16", steering=False, free_bytes=lambda _: 0)
    assert "--store-dtype" not in str(err.value) and "--no-steering" not in str(err.value)
    assert check_store_room(store, [], per_passage_layer, "float32", free_bytes=lambda _: 0) is None
    assert len(asked) == 3  # the worker is asked only where there is pooling left


def test_the_disk_asked_is_the_store_folders(tmp_path) -> None:
    """The free bytes read are those of the store's own folder (its mount), as shutil reports them."""
    import shutil

    store = LocalStore(tmp_path / "deep" / "store")
    seen: list = []
    check_store_room(store, plans(1, 2), lambda: 1, "float32",
                     free_bytes=lambda path: seen.append(path) or shutil.disk_usage(path).free)
    assert seen == [store.root] and np.isfinite(shutil.disk_usage(store.root).free)


def test_with_drop_pooled_the_largest_concept_must_fit_the_room_the_pooling_may_fill(tmp_path) -> None:
    """The room is ROOM_SHARE of the disk's free bytes; the largest concept (passages x layers left) must fit it
    whole, its D1 reading every layer at once: more stops with one line naming it; an S3 store, or nothing left to
    pool, counts no room."""
    store = LocalStore(tmp_path / "s")
    to_pool = [*plans(2, 20), (ConceptPlan("big", passages(20, "train"), "hb"), [0, 3])]  # 60 / 60 / 80 rows
    assert pooling_room(store, to_pool, lambda: 1000, "float32", free_bytes=lambda _: 100_000) == (90_000, 100_000)
    assert ROOM_SHARE == 0.9
    free = int(80_000 / ROOM_SHARE)  # 88,888: a room of 79,999
    with pytest.raises(StoreError) as err:
        pooling_room(store, to_pool, lambda: 1000, "float32", free_bytes=lambda _: free)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"store local:{store.root}: with --drop-pooled the largest "
                                                      "concept's pooling (concept big, 40 passages) needs at least "
                                                      "80000 bytes and the store may fill 79999 bytes (90% of its "
                                                      "disk's 88888 bytes free)")
    assert "--store-dtype bfloat16" in message
    assert pooling_room(store, to_pool, lambda: 1000, "float32", free_bytes=lambda _: free + 1) == (80_000, free + 1)
    assert pooling_room(store, [], lambda: 1000, "float32", free_bytes=lambda _: 0) == (None, None)
    assert pooling_room(S3Store.__new__(S3Store), to_pool, lambda: 1000, "float32") == (None, None)
