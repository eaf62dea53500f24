"""Two pooled tables of one concept made by different computations (another batch composition, chunking or
budget: a row padded next to other rows, GEMMs blocked for another row count) hold the same rows, and each vector
within float32 round-off of the tiny Llama's forward. Every column but the vectors is compared exactly.

The bound (tests/tolerances.py): 2 layers, each summing over 32 hidden, 64 MLP and up to 64 positions, relative to
the vector's norm: 4·eps32·√320 ≈ 8.5e-6 (measured at most 2.4e-7 on AVX-512), except S2_gradient_x_input within
1e-4 (measured 3.2e-5): its weights |grad . h| are dot products that nearly cancel on some tokens, so their
relative round-off has no a-priori bound; 1e-4 still catches a row pooled with another row's weights (off by O(1))."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from tolerances import float32_atol

TINY_LLAMA_TERMS = 2 * (32 + 64 + 64)  # roundings along the tiny Llama's forward at max_length 64
ROUND_OFF = float32_atol(1.0, TINY_LLAMA_TERMS)  # relative to the vector's norm
LOOSER = {"S2_gradient_x_input": 1e-4}
VECTOR_COLUMNS = ("vector", "pooled", "output")


def assert_same_tables(group: pa.Table, alone: pa.Table, what: str) -> None:
    """Same schema and metadata, same rows in the same order, every vector within its strategy's bound."""
    assert group.schema.equals(alone.schema, check_metadata=True), what
    for name in group.column_names:
        if name not in VECTOR_COLUMNS:
            assert group.column(name).equals(alone.column(name)), f"{what}: column {name}"
    bound = np.array([LOOSER.get(s, ROUND_OFF) for s in group.column("strategy").to_pylist()])
    for name in VECTOR_COLUMNS:
        if name in group.column_names:
            a, b = (t.column(name).combine_chunks() for t in (group, alone))
            width = a.type.list_size
            x = a.values.to_numpy(zero_copy_only=False).reshape(-1, width)
            y = b.values.to_numpy(zero_copy_only=False).reshape(-1, width)
            relative = np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), 1e-30)
            worst = int(np.argmax(relative / bound))
            assert relative[worst] <= bound[worst], (f"{what}: {name} of {group.column('strategy')[worst]} off by "
                                                     f"{relative[worst]:.2e} of its norm")
