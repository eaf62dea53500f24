"""Pooled artifacts sharded by (concept, layer): one shard per layer under a manifest, a D1 task that opens one
layer only, resume that recomputes only missing shards, and 16-bit storage read back as float32."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from negation_pairs import passages

from poolbench.config import ProbingOptions, RunConfig
from poolbench.corpus.passage import Passage
from poolbench.driver.pipeline import plan_cells
from poolbench.driver.run_plan import RunInputs
from poolbench.errors import StoreError
from poolbench.pooler.concept_pooling import pool_concept_tables
from poolbench.pooler.iti import encode_head_table, head_table_key
from poolbench.pooler.pooled_table import (
    PooledTableBuilder,
    PooledTableView,
    bfloat16_bits,
    decode_vectors,
    encode_vectors,
    pooled_layers,
    read_pooled_table,
    stored_values,
)
from poolbench.pooler.registry import get_strategy, resolve_strategies
from poolbench.pooler.worker import ExtractorWorker
from poolbench.prober.concept_probe import gather_layer_d1, probe_layer_task, probe_pooled_table
from poolbench.records.d1 import d1_records_from_table
from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore


def constructed_table(values: np.ndarray, layers: list[int], strategies: list[str],
                      data: list[Passage]) -> pa.Table:
    """A PooledTable from given vectors [L, S, N, d], one batch of every passage."""
    builder = PooledTableBuilder(data, values.shape[-1])
    builder.add(values, layers, strategies, [p.id for p in data], np.zeros((len(strategies), len(data)), bool))
    return builder.table()


def test_float16_round_trip_is_float32_rounded_to_half() -> None:
    data = passages(1, "train")
    x = np.array([1.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 0.1, -2.5, 65504.0], dtype=np.float32)
    table = constructed_table(np.stack([x, -x]).reshape(1, 1, 2, 6), [0], ["A1_mean"], data)
    stored = encode_vectors(table, "float16")
    assert stored.schema.field("vector").type == pa.list_(pa.float16(), 6)
    # Half precision keeps 10 mantissa bits: 1 + 2^-11 is a tie (to even: 1), 1 + 3*2^-11 rounds up to 1 + 2^-9,
    # 0.1 becomes 1638/16384.
    want = np.array([1.0, 1.0, 1 + 2.0**-9, 1638 / 16384, -2.5, 65504.0], dtype=np.float32)
    np.testing.assert_array_equal(decode_vectors(stored), np.stack([want, -want]))
    assert decode_vectors(stored).dtype == np.float32
    np.testing.assert_array_equal(decode_vectors(stored), np.stack([x, -x]).astype(np.float16).astype(np.float32))


def test_bfloat16_round_trip_keeps_the_top_half_of_float32_rounded_to_even() -> None:
    data = passages(1, "train")
    x = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.14159, -2.0, 1e30], dtype=np.float32)
    table = constructed_table(x.reshape(1, 1, 1, 6).repeat(2, axis=2), [0], ["A1_mean"], data)
    stored = encode_vectors(table, "bfloat16")
    assert stored.schema.field("vector").type == pa.list_(pa.uint16(), 6)
    assert stored.schema.field("vector").metadata == {b"poolbench.dtype": b"bfloat16"}
    # 7 mantissa bits: 1 + 2^-8 is a tie (to even: 1), 1 + 3*2^-8 a tie rounding up to 1 + 2^-6, pi to
    # 2 * (1 + 73/128); 1e30 (0x7149F2CA) keeps float32's exponent range and rounds up to 0x714A.
    bits = stored.column("vector").combine_chunks().values.to_numpy()[:6]
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x4049, 0xC000, 0x714A]
    want = np.array([1.0, 1.0, 1 + 2.0**-6, 2 * (1 + 73 / 128), -2.0, np.uint32(0x714A << 16).view(np.float32)],
                    dtype=np.float32)
    np.testing.assert_array_equal(decode_vectors(stored)[0], want)
    # Stored and read back through the store, the dtype travels with the column.
    assert PooledTableView(encode_vectors(table, "bfloat16")).matrix(0, "A1_mean").X.dtype == np.float32


def test_float16_refuses_a_value_it_cannot_hold(tmp_path) -> None:
    data = passages(1, "train")
    table = constructed_table(np.full((1, 1, 2, 3), 70000.0, np.float32), [3], ["P2_first"], data)
    with pytest.raises(StoreError, match="layer 3 P2_first: pooled value 70000 exceeds float16's 65504"):
        encode_vectors(table, "float16")
    assert decode_vectors(encode_vectors(table, "bfloat16"))[0, 0] == 70144.0  # 0x4789 << 16: no overflow


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_encoding_a_layer_chunk_by_chunk_equals_converting_its_whole_column(dtype) -> None:
    """A job's layer table comes as one slice a strategy and batch (chunks at offsets into each batch's buffer);
    encode_vectors converts them into one output buffer with no float32 copy of the column. The result must be
    the whole column converted at once (numpy's float16 cast; bfloat16_bits), in one chunk, the other columns as
    they were; S3's head table too (its outputs untouched)."""
    pooled = synthetic_pooled([0, 3])
    for table, column in ((pooled.tables[3], "vector"), (pooled.heads[3], "pooled")):
        assert table.column(column).num_chunks >= 3
        X = decode_vectors(table, column)
        stored = encode_vectors(table, dtype, column=column)
        assert stored.column(column).num_chunks == 1
        want = X.astype(np.float16) if dtype == "float16" else bfloat16_bits(X)
        np.testing.assert_array_equal(stored_values(stored, column), want)
        assert stored.drop_columns([column]).equals(table.drop_columns([column]))
        np.testing.assert_array_equal(decode_vectors(encode_vectors(stored, "float32", column=column), column),
                                      decode_vectors(stored, column))  # back to float32: the values it stands for


def test_a_value_float16_cannot_hold_in_a_later_chunk_is_named_by_its_own_row() -> None:
    """The check runs chunk by chunk: the row it names is the chunk's offset plus its row there. Here only the
    last batch's P2_first row holds 1e5, and the first rows of the layer are A1_mean's: a check that forgot the
    offset would name A1_mean."""
    data = (passages(6, "train") + passages(3, "test"))[:12]
    builder = PooledTableBuilder(data, 4)
    for start in (0, 4, 8):
        values = np.zeros((1, 2, 4, 4), np.float32)
        if start == 8:
            values[0, 1, 3, 2] = 1e5
        builder.add(values, [7], ["A1_mean", "P2_first"], [p.id for p in data[start:start + 4]],
                    np.zeros((2, 4), bool))
    with pytest.raises(StoreError, match="layer 7 P2_first: pooled value 100000 exceeds float16's 65504"):
        encode_vectors(builder.layer_tables()[7], "float16")


def test_store_dtype_and_layer_name_different_artifacts(tmp_path) -> None:
    model = {"model_id": "m", "weights_hash": "w", "dtype": "torch.float32", "n_layers": 2, "kind": "causal"}
    from poolbench.driver.run_plan import ConceptPlan

    specs = resolve_strategies(["A1_mean"])
    inputs = RunInputs(specs, None, str(tmp_path), LocalStore(tmp_path),  # type: ignore[arg-type]
                       [ConceptPlan("hedging", passages(2, "train"), "h")])
    keys = {d: plan_cells(RunConfig(store_dtype=d, strategies=("A1_mean",)), inputs, model).plans[0]
            for d in ("float32", "float16", "bfloat16")}
    assert len({p.pooled_key for p in keys.values()}) == 3 and len({p.d1_key for p in keys.values()}) == 3
    # A float32 store's key is what it was before 16-bit stores held S3's head vectors at 16 bits (its bytes did
    # not change); the 16-bit stores' keys are new (before: pooled/a0f5e9af..., pooled/e7c12cf6...).
    assert {d: p.pooled_key for d, p in keys.items()} == {"float32": "pooled/58250ab7295f36032b9800325940b23c",
                                                          "float16": "pooled/f367b38c71a3a6f35c72c497880c1db2",
                                                          "bfloat16": "pooled/029b0a78a6bf77d1699d57c578809e30"}
    f32 = keys["float32"].pooled_key
    shards = [layer_shard_key(f32, layer) for layer in (0, 1)]
    assert all(s.startswith("pooled/") for s in shards) and len({f32, *shards}) == 3
    assert layer_shard_key(f32, 1) == shards[1]  # deterministic: a rerun finds the shard
    assert layer_shard_key(keys["float16"].pooled_key, 1) != shards[1]


def test_probing_layer_by_layer_equals_probing_the_whole_concept() -> None:
    """Every D1 statistic is per cell: two layers probed apart give the records of the whole table, in order."""
    rng = np.random.default_rng(0)
    data = passages(12, "train") + passages(6, "test")
    y = np.array([p.label for p in data])
    values = rng.normal(size=(2, 2, len(data), 8)).astype(np.float32)
    values[1, 0, :, 0] += 1.5 * y  # layer 3, A1: a weak signal, so AUROCs are not all 1
    table = constructed_table(values, [1, 3], ["A1_mean", "P1_last"], data)
    for flash in (None, "1/2"):  # a flash subset is drawn per concept, the same at every layer
        kwargs = {"n_folds": 3, "n_bootstrap": 30, "seed": 2, "flash": flash}
        whole = probe_pooled_table(table, "negation", **kwargs)
        by_layer = [r for layer in (1, 3) for r in probe_pooled_table(
            table.filter(pc.equal(table.column("layer"), layer)), "negation", **kwargs)]
        assert [r.to_dict() for r in by_layer] == [r.to_dict() for r in whole]
        assert {r.n_train for r in whole} == {24 if flash is None else 12}
        assert 0.6 < next(r.test_auroc for r in whole if (r.layer, r.strategy) == (3, "A1_mean")) < 1.0


class OpenedKeys:
    """Records every table key a store opens."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        original = ArtifactStore.get_table

        def spy(store: ArtifactStore, key: str) -> pa.Table:
            self.keys.append(key)
            return original(store, key)

        monkeypatch.setattr(ArtifactStore, "get_table", spy)


def test_worker_shards_by_layer_a_d1_task_reads_one_and_resume_fills_only_the_gap(
        tiny_llama_dir, tmp_path, monkeypatch) -> None:
    store_url = str(tmp_path / "store")
    store = LocalStore(tmp_path / "store")
    worker = ExtractorWorker(str(tiny_llama_dir))
    data = passages(12, "train") + passages(6, "test")
    strategies = ["A1_mean", "P1_last", "S3_iti_probe"]
    summary = worker.pool_concept("negation", data, [0, 1], strategies, store_url=store_url, key="pooled/k",
                                  metadata={"concept": "negation"}, batch_size=8, max_length=64)
    assert summary["layers"] == [0, 1] and summary["rows"] == 2 * 3 * 36
    assert pooled_layers(store, "pooled/k") == [0, 1]
    shards = {layer: layer_shard_key("pooled/k", layer) for layer in (0, 1)}
    for layer, key in shards.items():
        shard = store.get_table(key)
        assert set(shard.column("layer").to_pylist()) == {layer} and shard.num_rows == 3 * 36
        assert sorted(set(shard.column("strategy").to_pylist())) == sorted(strategies)
        assert set(store.get_table(head_table_key(key)).column("layer").to_pylist()) == {layer}

    opened = OpenedKeys(monkeypatch)
    for layer in (0, 1):
        probe_layer_task(store_url, "pooled/k", "d1/k", "negation", layer,
            ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False))
        if layer == 1:
            assert opened.keys == [shards[0], head_table_key(shards[0]), shards[1], head_table_key(shards[1])]
    assert gather_layer_d1(store, "d1/k", [1, 0]) == 2 * 3 * 2

    # The unsharded computation: one in-memory table of every layer, probed at once.
    out = pool_concept_tables(worker.loaded, data, [0, 1], [get_strategy(s) for s in strategies], batch_size=8,
                              max_length=64)
    whole = probe_pooled_table(out.pooled, "negation", n_folds=3, n_bootstrap=20, reliability=False,
                               heads=out.heads)
    gathered = d1_records_from_table(store.get_table("d1/k"))
    assert [r.to_dict() for r in gathered] == [r.to_dict() for r in whole]

    # Killed after layer 0's shard: the resumed worker pools layer 1 only and leaves layer 0's file alone.
    path0 = tmp_path / "store" / f"{shards[0]}.arrow"
    stamp, before = path0.stat().st_mtime_ns, store.get_table(shards[1])
    store.delete(shards[1])
    store.delete("pooled/k")
    again = worker.pool_concept("negation", data, [1], strategies, store_url=store_url, key="pooled/k",
                                metadata={"concept": "negation"}, batch_size=8, max_length=64, all_layers=[0, 1])
    assert again["layers"] == [1] and path0.stat().st_mtime_ns == stamp
    assert store.get_table(shards[1]).equals(before) and pooled_layers(store, "pooled/k") == [0, 1]
    assert read_pooled_table(store, "pooled/k").num_rows == 2 * 3 * 36

    # A 16-bit store: its shards hold float16, and D1 is D1 of the float32 vectors rounded to float16 by hand.
    worker.pool_concept("negation", data, [0, 1], ["A1_mean", "P1_last"], store_url=store_url, key="pooled/h",
                        metadata={"concept": "negation"}, batch_size=8, max_length=64, store_dtype="float16")
    half = store.get_table(layer_shard_key("pooled/h", 1))
    assert half.schema.field("vector").type.value_type == pa.float16()
    full = pool_concept_tables(worker.loaded, data, [0, 1], [get_strategy("A1_mean"), get_strategy("P1_last")],
                               batch_size=8, max_length=64).layers[1]
    np.testing.assert_array_equal(decode_vectors(half), decode_vectors(full).astype(np.float16).astype(np.float32))
    probe_layer_task(store_url, "pooled/h", "d1/h", "negation", 1,
        ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False))
    rounded = full.set_column(full.schema.get_field_index("vector"), "vector", pa.FixedSizeListArray.from_arrays(
        pa.array(decode_vectors(full).astype(np.float16).astype(np.float32).reshape(-1)), 32))
    want = probe_pooled_table(rounded, "negation", n_folds=3, n_bootstrap=20, reliability=False)
    got = d1_records_from_table(store.get_table(layer_shard_key("d1/h", 1)))
    assert [r.to_dict() for r in got] == [r.to_dict() for r in want]

    # A bfloat16 store with S3: D1 chooses heads and probes on the stored per-head vectors, rounded as stored.
    worker.pool_concept("negation", data, [1], ["P1_last", "S3_iti_probe"], store_url=store_url, key="pooled/b",
                        metadata={"concept": "negation"}, batch_size=8, max_length=64, store_dtype="bfloat16")
    probe_layer_task(store_url, "pooled/b", "d1/b", "negation", 1,
        ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False))
    out = pool_concept_tables(worker.loaded, data, [1], [get_strategy("P1_last"), get_strategy("S3_iti_probe")],
                              batch_size=8, max_length=64)
    assert out.heads is not None
    want = probe_pooled_table(encode_vectors(out.pooled, "bfloat16"), "negation", n_folds=3, n_bootstrap=20,
                              reliability=False, heads=encode_head_table(out.heads, "bfloat16"))
    got = d1_records_from_table(store.get_table(layer_shard_key("d1/b", 1)))
    assert [r.to_dict() for r in got] == [r.to_dict() for r in want]
    stored = store.get_table(head_table_key(layer_shard_key("pooled/b", 1)))
    assert stored.schema.field("pooled").type.value_type == pa.uint16()
    assert stored.equals(encode_head_table(out.heads, "bfloat16").combine_chunks())


def synthetic_pooled(layers: list[int], big_layer: int | None = None, big_head_layer: int | None = None):
    """A concept's tables as the capture leaves them (several chunks a layer) with S3's head tables; `big_layer`
    holds a value float16 cannot, `big_head_layer` one in head 2's pooled vector of its last chunk."""
    from poolbench.pooler.iti import ITIHeadTableBuilder
    from poolbench.pooler.worker import _Pooled

    data = passages(6, "train") + passages(3, "test")  # 12 passages: matched pairs
    rng = np.random.default_rng(1)
    builder = PooledTableBuilder(data, 8)
    heads = {layer: ITIHeadTableBuilder(8) for layer in layers}
    for start in (0, 4, 8):
        ids = [p.id for p in data[start:start + 4]]
        values = rng.standard_normal((len(layers), 2, len(ids), 8)).astype(np.float32)
        if big_layer is not None:
            values[layers.index(big_layer), 0, 0, 0] = 7e4
        builder.add(values, layers, ["A1_mean", "S3_iti_probe"], ids, np.zeros((2, len(ids)), bool))
        for layer in layers:
            head_values = rng.standard_normal((1, len(ids), 3, 8)).astype(np.float32)
            if layer == big_head_layer and start == 8:
                head_values[0, 1, 2, 5] = -9e4
            heads[layer].add("S3_iti_probe", [layer], ids, head_values,
                             rng.standard_normal((1, len(ids), 3, 2)).astype(np.float32))
    return _Pooled(builder.layer_tables({"concept": "c"}), {layer: h.table() for layer, h in heads.items()}, (), 0,
                   0.0, None)


class WriteOrder(LocalStore):
    """A LocalStore that records each object as it is written, from whichever thread."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.written: list[str] = []

    def _commit(self, name, metadata, fill) -> None:
        super()._commit(name, metadata, fill)
        self.written.append(name)


def test_shards_written_on_several_threads_are_the_objects_one_thread_writes(tmp_path) -> None:
    """ExtractorWorker._store on 3 writer threads: every object byte for byte as on one (same checksums), each
    layer's head table stored before its shard, the manifest last; shard_writers caps at the layers."""
    from poolbench.pooler.worker import PoolTask, shard_writers

    layers = [0, 2, 5, 7]
    rows = sum(t.num_rows for t in synthetic_pooled(layers).tables.values())
    task = PoolTask("c", [], "pooled/c", {}, tuple(layers))
    stores = {n: WriteOrder(tmp_path / f"w{n}") for n in (1, 3)}
    for n, store in stores.items():
        done = synthetic_pooled(layers)
        summary = ExtractorWorker._store(store, task, layers, done, "bfloat16", layers, writers=n)
        assert summary["layers"] == layers and summary["rows"] == rows
        assert done.tables == {} and done.heads == {}  # each layer let go of once written (host_room.VectorBytes)
    one, three = stores[1], stores[3]
    assert sorted(one.written) == sorted(three.written) and len(one.written) == 2 * len(layers) + 1
    for name in one.written:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w3" / name).read_bytes(), name
    for layer in layers:
        shard = layer_shard_key("pooled/c", layer)
        assert three.written.index(f"{head_table_key(shard)}.arrow") < three.written.index(f"{shard}.arrow")
    assert three.written[-1] == "pooled/c.json" and pooled_layers(three, "pooled/c") == layers
    assert shard_writers(4, None) >= 1 and shard_writers(4, 9) == 4 and shard_writers(0, 3) == 1


@pytest.mark.parametrize(("layers", "big", "message"), [
    ([0, 1, 2], {"big_layer": 2}, r"concept c layer 2 A1_mean: pooled value 70000 exceeds"),
    ([0, 4], {"big_head_layer": 4}, r"concept c layer 4 S3_iti_probe head 2: pooled value 90000 exceeds"),
])
def test_a_value_float16_cannot_hold_stops_the_concept_before_any_write(tmp_path, layers, big, message) -> None:
    """Every layer is checked before any object is written, on any number of threads: a value float16 cannot
    hold in one layer's PooledTable or in one of S3's per-head vectors (stored at the store's dtype too) leaves the
    store empty, and the error names the concept, the layer, the strategy (and the head)."""
    from poolbench.pooler.worker import PoolTask

    store = WriteOrder(tmp_path / "s")
    with pytest.raises(StoreError, match=message):
        ExtractorWorker._store(store, PoolTask("c", [], "pooled/c", {}, tuple(layers)), layers,
                               synthetic_pooled(layers, **big), "float16", layers, writers=3)
    assert store.written == []


def test_a_16_bit_store_holds_s3s_head_vectors_at_16_bits_and_their_outputs_at_32(tmp_path) -> None:
    """The head vectors are most of a concept's bytes at d 4,096 (32 a passage and layer); a bfloat16 store keeps
    them as bfloat16 bits (float32 rounded to nearest even, read back as float32), each head's output as it was."""
    from poolbench.pooler.iti import ITIHeadView
    from poolbench.pooler.worker import PoolTask

    layers = [0, 3]
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        store = LocalStore(tmp_path / dtype)
        built = synthetic_pooled(layers).heads[3]  # the same tables as the ones written (a seeded generator)
        ExtractorWorker._store(store, PoolTask("c", [], "pooled/c", {}, tuple(layers)), layers,
                               synthetic_pooled(layers), dtype, layers)
        stored = store.get_table(head_table_key(layer_shard_key("pooled/c", 3)))
        want_type = pa.uint16() if dtype == "bfloat16" else pa.float32()
        assert stored.schema.field("pooled").type == pa.list_(want_type, 8)
        assert stored.schema.field("output").type == pa.list_(pa.float32(), 2)
        ids = np.array([p for p in dict.fromkeys(built.column("passage_id").to_pylist())])
        got, want = ITIHeadView(stored).cell(3, "S3_iti_probe", ids), ITIHeadView(built).cell(3, "S3_iti_probe", ids)
        rounded = want[0] if dtype == "float32" else \
            torch.from_numpy(want[0]).to(torch.bfloat16).to(torch.float32).numpy()
        np.testing.assert_array_equal(got[0], rounded)
        np.testing.assert_array_equal(got[1], want[1])
        assert dtype == "float32" or not np.array_equal(got[0], want[0])  # the rounding is there to see
        sizes[dtype] = stored.column("pooled").combine_chunks().values.nbytes
    assert sizes == {"float32": 12 * 3 * 8 * 4, "bfloat16": 12 * 3 * 8 * 2}  # 12 passages x 3 heads x d 8


def test_bfloat16_bits_and_the_float16_range_check_read_in_blocks(monkeypatch) -> None:
    """Both walk the vectors a block at a time (S3's head vectors are ~1 GB a layer at the full corpus); blocks
    that split rows give the bits and the first bad row that one pass over the whole array gives."""
    import poolbench.pooler.pooled_table as pooled_table

    rng = np.random.default_rng(3)
    X = (rng.standard_normal((7, 5)) * 1e4).astype(np.float32)
    X[0, 0], X[1, 1], X[2, 2], X[5, 3] = np.inf, -0.0, np.float32(1 + 2.0**-8), 7e4
    bits = X.view(np.uint32).astype(np.uint64)
    whole = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    for block in (3, 5, 11, 1 << 20):
        monkeypatch.setattr(pooled_table, "_BLOCK", block)
        np.testing.assert_array_equal(pooled_table.bfloat16_bits(X), whole)
        assert pooled_table._first_row_over(X[1:], 65504.0) == 4  # row 5 of X; row 0's inf is left out
        assert pooled_table._first_row_over(X[6:], 65504.0) is None


def test_an_actor_pools_its_next_job_while_the_first_ones_shards_are_written(tiny_llama_dir, tmp_path,
                                                                             monkeypatch) -> None:
    """The extractor actor's class (compute thread for the forwards, the caller's thread for the writes) given two
    jobs at once, as a GPU's queue gives them: the second job's forwards start before the first job's writes end,
    every forward runs on the one compute thread, and each job's shards are its own."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from poolbench.compute_thread import with_compute_thread
    from poolbench.driver.extractor_fleet import COMPUTE_METHODS
    from poolbench.pooler.worker import PoolTask

    events: list[tuple[str, str, float]] = []
    compute_threads: set[int] = set()
    first_written = threading.Event()
    original_compute, original_store = ExtractorWorker._compute_group, ExtractorWorker._store

    def compute(self, tasks, *args, **kwargs):
        compute_threads.add(threading.get_ident())
        events.append(("compute start", tasks[0].concept, time.monotonic()))
        try:
            return original_compute(self, tasks, *args, **kwargs)
        finally:
            events.append(("compute end", tasks[0].concept, time.monotonic()))

    def store(store_, task, *args, **kwargs):
        events.append(("write start", task.concept, time.monotonic()))
        if task.concept == "first":  # hold the first job's writes until the second job's forwards have begun
            assert first_written.wait(60)
        summary = original_store(store_, task, *args, **kwargs)
        events.append(("write end", task.concept, time.monotonic()))
        return summary

    monkeypatch.setattr(ExtractorWorker, "_compute_group", compute)
    monkeypatch.setattr(ExtractorWorker, "_store", staticmethod(store))
    worker = with_compute_thread(ExtractorWorker, COMPUTE_METHODS)(
        str(tiny_llama_dir))
    data = passages(4, "train") + passages(2, "test")
    url = str(tmp_path / "store")

    def job(concept: str) -> list[dict]:
        task = PoolTask(concept, data, f"pooled/{concept}", {"concept": concept}, (0, 1))
        result = worker.pool_concepts([task], ["A1_mean", "P1_last"], store_url=url, batch_size=4, max_length=48)
        return result

    def wait_for(what: str, concept: str) -> None:
        deadline = time.monotonic() + 90
        while not any(e[:2] == (what, concept) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)

    with ThreadPoolExecutor(2) as callers:
        first = callers.submit(job, "first")
        wait_for("compute end", "first")
        second = callers.submit(job, "second")
        wait_for("compute start", "second")  # with the writes on the compute thread: never, until the 60 s hold ends
        first_written.set()
        summaries = {s["concept"]: s for s in first.result() + second.result()}
    order = [(what, concept) for what, concept, _ in sorted(events, key=lambda e: e[2])]
    assert order.index(("compute start", "second")) < order.index(("write end", "first"))
    assert len(compute_threads) == 1 and threading.get_ident() not in compute_threads
    store_ = LocalStore(tmp_path / "store")
    for concept in ("first", "second"):
        assert summaries[concept]["layers"] == [0, 1] and pooled_layers(store_, f"pooled/{concept}") == [0, 1]
