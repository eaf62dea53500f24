"""--dump-activations: token-level rows for real tokens only, float16, indices counted from each passage's start."""

import numpy as np

from poolbench.extractor.activation_dump import activation_dump_table
from poolbench.extractor.activations import ActivationBatch


def test_dump_keeps_real_tokens_with_their_offsets():
    hidden = np.arange(2 * 2 * 3 * 2, dtype=np.float32).reshape(2, 2, 3, 2)  # L=2, B=2, T=3, d=2
    mask = np.array([[False, True, True], [True, True, True]])  # passage a is left-padded
    offsets = np.array([[[0, 0], [0, 0], [0, 4]], [[0, 0], [0, 3], [4, 7]]], dtype=np.int32)
    batch = ActivationBatch(passage_ids=["a", "b"], texts=["word", "the end"], layers=(3, 5), hidden=hidden,
                            attention_mask=mask, input_ids=np.array([[0, 1, 7], [1, 8, 9]]), offsets=offsets,
                            special_mask=np.array([[False, True, False], [True, False, False]]))
    table = activation_dump_table(batch)
    assert table.num_rows == 2 * 5  # 5 real tokens at each of 2 layers
    rows = table.to_pylist()
    assert [(r["passage_id"], r["layer"], r["token_index"], r["token_id"]) for r in rows[:5]] == [
        ("a", 3, 0, 1), ("a", 3, 1, 7), ("b", 3, 0, 1), ("b", 3, 1, 8), ("b", 3, 2, 9)]
    assert (rows[1]["char_start"], rows[1]["char_end"]) == (0, 4)
    # layer 5 (index 1), passage a, its 2nd real token sits at t=2: hidden[1, 0, 2] = [16, 17]
    assert rows[6]["passage_id"] == "a" and rows[6]["token_index"] == 1
    assert rows[6]["vector"] == [16.0, 17.0]
    assert str(table.schema.field("vector").type.value_type) == "halffloat"
