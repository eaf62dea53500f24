"""PooledTable and S3's ITIHeadTable: rows land under the right (layer, strategy, passage[, head]) and decode
back to the same arrays."""

import numpy as np
import pyarrow as pa
import pytest

from poolbench.corpus.passage import Passage
from poolbench.errors import StoreError
from poolbench.pooler.iti import ITIHeadTableBuilder, ITIHeadView, needs_head_table
from poolbench.pooler.pooled_table import PooledTableBuilder, PooledTableView


def passage(i, label, split, pair=None):
    return Passage(id=f"p{i}", text="t", label=label, domain="d", token_count=1, matched_pair_id=pair,
                   split=split, concept="c")


PASSAGES = [passage(0, 1, "train", "g0"), passage(1, 0, "train", "g0"), passage(2, 1, "test"),
            passage(3, 0, "test")]


def test_round_trip_places_every_vector():
    builder = PooledTableBuilder(PASSAGES, hidden_size=3)
    # Two batches, L=2 layers, S=2 strategies; vector value encodes (layer, strategy, passage).
    for ids in (["p0", "p2"], ["p1", "p3"]):
        vecs = np.zeros((2, 2, 2, 3), np.float32)
        for li, layer in enumerate((4, 7)):
            for si in range(2):
                for bi, pid in enumerate(ids):
                    vecs[li, si, bi] = [layer, si, int(pid[1:])]
        fallback = np.array([[False, False], [ids == ["p1", "p3"], False]])
        builder.add(vecs, [4, 7], ["A1_mean", "P1_last"], ids, fallback)
    table = builder.table({"concept": "c"})
    assert table.num_rows == 4 * 2 * 2
    assert table.schema.metadata == {b"concept": b"c"}
    assert table.schema.field("vector").type == pa.list_(pa.float32(), 3)

    view = PooledTableView(table)
    assert view.cells == [(4, "A1_mean"), (4, "P1_last"), (7, "A1_mean"), (7, "P1_last")]
    m = view.matrix(7, "P1_last")
    assert list(m.passage_ids) == ["p0", "p2", "p1", "p3"]
    np.testing.assert_array_equal(m.X, [[7, 1, 0], [7, 1, 2], [7, 1, 1], [7, 1, 3]])
    np.testing.assert_array_equal(m.y, [1, 1, 0, 0])
    np.testing.assert_array_equal(m.fallback, [False, False, True, False])
    train = m.subset("train")
    assert list(train.passage_ids) == ["p0", "p1"]
    assert list(train.groups) == ["g0", "g0"]
    assert list(m.subset("test").groups) == ["p2", "p3"]


def test_head_table_keeps_each_head_at_its_own_width_and_reorders_to_the_pooled_rows():
    """Two batches, 2 layers, 3 heads, d=4, Dh=2: values encode (layer, passage, head), so every row is checked."""
    builder = ITIHeadTableBuilder(hidden_size=4)
    for ids in (["p0", "p2"], ["p1", "p3"]):
        pooled = np.zeros((2, 2, 3, 4), np.float32)
        outputs = np.zeros((2, 2, 3, 2), np.float32)
        for li, layer in enumerate((4, 7)):
            for bi, pid in enumerate(ids):
                for h in range(3):
                    pooled[li, bi, h] = [layer, int(pid[1:]), h, 9]
                    outputs[li, bi, h] = [int(pid[1:]), h]
        builder.add("S3_iti_probe", [4, 7], ids, pooled, outputs)
    table = builder.table({"S3_iti_probe:head_fraction": "0.5"})
    assert table.num_rows == 2 * 2 * 2 * 3
    assert table.schema.field("pooled").type == pa.list_(pa.float32(), 4)
    assert table.schema.field("output").type == pa.list_(pa.float32(), 2)  # no padding to d

    view = ITIHeadView(table)
    assert view.head_fraction("S3_iti_probe") == 0.5 and view.head_fraction("other") == 0.25
    per_head, outs = view.cell(7, "S3_iti_probe", np.array(["p3", "p0", "p2", "p1"]))
    assert per_head.shape == (3, 4, 4) and outs.shape == (4, 3, 2)
    np.testing.assert_array_equal(per_head[2], [[7, 3, 2, 9], [7, 0, 2, 9], [7, 2, 2, 9], [7, 1, 2, 9]])
    np.testing.assert_array_equal(outs[1], [[0, 0], [0, 1], [0, 2]])
    with pytest.raises(StoreError, match="S3_iti_probe layer 7 does not hold every head of every passage"):
        view.cell(7, "S3_iti_probe", np.array(["p0", "p1", "p2", "p3", "p9"]))
    with pytest.raises(StoreError, match="S3_iti_probe layer 5"):
        view.cell(5, "S3_iti_probe", np.array(["p0"]))


def test_needs_head_table_reads_the_pooled_metadata():
    builder = PooledTableBuilder(PASSAGES, hidden_size=3)
    assert not needs_head_table(builder.table({"concept": "c"}))
    assert needs_head_table(builder.table({"concept": "c", "S3_iti_probe:heads": "4"}))


def test_each_layer_owns_a_copy_of_its_rows():
    """A pooler's vectors are views of a host buffer that the next chunk overwrites, and the writer frees a layer's
    table as soon as it is written: so each layer's rows are copied into a buffer of their own. Overwriting the
    input after `add` changes no table, and no two layers' vectors share memory (one buffer over every layer would
    stay held until the job's last layer is written)."""
    builder = PooledTableBuilder(PASSAGES, hidden_size=3)
    vecs = np.arange(3 * 2 * 4 * 3, dtype=np.float32).reshape(3, 2, 4, 3)  # L=3, S=2, B'=4 (2 of them ours)
    want = vecs.copy()
    builder.add(vecs, [0, 5, 9], ["A1_mean", "P1_last"], ["p3", "p1"], np.zeros((2, 2), bool), rows=np.array([3, 1]))
    vecs[:] = -1.0
    tables = builder.layer_tables()
    views = {layer: [chunk.flatten().to_numpy() for chunk in table.column("vector").chunks]
             for layer, table in tables.items()}
    for li, layer in enumerate((0, 5, 9)):
        m = PooledTableView(tables[layer]).matrix(layer, "P1_last")
        assert list(m.passage_ids) == ["p3", "p1"]
        np.testing.assert_array_equal(m.X, want[li, 1, [3, 1]])
        for other in (0, 5, 9):
            if other != layer:
                assert not any(np.shares_memory(a, b) for a in views[layer] for b in views[other])
