"""PooledTable: rows land under the right (layer, strategy, passage) and decode back to the same arrays."""

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import Passage
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
