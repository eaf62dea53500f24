"""The slot table on CPU torch: equal deltas share a slot, tokens map to their request's slot, and each token adds
its own request's delta and nothing else (rows with different slots never see each other's vectors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import assert_float32_close

from poolbench.steerer.slot_table import (
    add_slot_vectors,
    build_layer_tables,
    build_slot_table,
    token_slots,
    write_token_slots,
)

pytestmark = pytest.mark.numerics  # float results that depend on the CPU's kernels


def test_table_has_the_zero_row_first_and_equal_deltas_share_a_slot():
    a, b = np.array([1.0, 2.0, 3.0]), np.array([0.0, -1.0, 0.5])
    table, slots = build_slot_table([None, a, b, a.copy(), None], 3)
    assert slots == [0, 1, 2, 1, 0]
    np.testing.assert_array_equal(table, np.array([[0, 0, 0], [1, 2, 3], [0, -1, 0.5]], np.float32))
    assert table.dtype == np.float32
    table, slots = build_slot_table([None, None], 3)
    assert slots == [0, 0] and table.shape == (1, 3)


def test_layer_tables_keep_each_slot_at_its_own_layer():
    a, b = np.array([1.0, 2.0]), np.array([3.0, 4.0])
    tables, slots = build_layer_tables([0, 3, 3, 0, 5], [a, a, b, None, None], 2)
    assert slots == [1, 2, 3, 0, 0] and sorted(tables) == [0, 3]  # (0, a) and (3, a) are different slots
    np.testing.assert_array_equal(tables[0], [[0, 0], [1, 2], [0, 0], [0, 0]])
    np.testing.assert_array_equal(tables[3], [[0, 0], [0, 0], [1, 2], [3, 4]])


def test_tokens_take_their_requests_slot_in_batch_order():
    np.testing.assert_array_equal(token_slots([2, 0, 1], [3, 1, 2]), [2, 2, 2, 0, 1, 1])
    np.testing.assert_array_equal(token_slots([], []), np.zeros(0))


def test_the_index_is_rewritten_in_place_with_padding_at_slot_zero():
    index = torch.full((6,), 7, dtype=torch.int64)
    same = write_token_slots(index, np.array([1, 2, 2]))
    assert same is index and index.tolist() == [1, 2, 2, 0, 0, 0]
    grown = write_token_slots(index, np.arange(8) % 3)
    assert grown is not index and grown.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_each_token_adds_its_own_requests_delta_only():
    rng = np.random.default_rng(0)
    d = 5
    deltas = [None, rng.normal(size=d), rng.normal(size=d), None]
    table_np, slots = build_slot_table(deltas, d)
    counts = [4, 1, 3, 2]  # request 0 is a prefill of 4 tokens, the others decode or prefill
    index = write_token_slots(torch.zeros(16, dtype=torch.int64), token_slots(slots, counts))
    hidden = torch.as_tensor(rng.normal(size=(sum(counts), d)), dtype=torch.float32)
    out = add_slot_vectors(hidden, torch.as_tensor(table_np), index)
    owner = np.repeat(np.arange(4), counts)
    for t in range(sum(counts)):
        want = np.zeros(d) if deltas[owner[t]] is None else deltas[owner[t]]
        # float32: the delta's cast, the add and the subtraction back are 3 roundings of |hidden| + |delta|
        assert_float32_close((out[t] - hidden[t]).numpy(), want, terms=3,
                             scale=float(hidden[t].abs().max()) + float(np.abs(want).max()))
    # Unsteered tokens come back bit for bit.
    unsteered = torch.as_tensor(owner == 0) | torch.as_tensor(owner == 3)
    assert torch.equal(out[unsteered], hidden[unsteered])


def test_half_precision_hidden_states_keep_their_dtype():
    table = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    index = torch.tensor([1, 0, 0])
    out = add_slot_vectors(torch.zeros(2, 2, dtype=torch.bfloat16), table, index)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[1.0, -1.0], [0.0, 0.0]]
