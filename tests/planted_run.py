"""A run's stored pooled table with a known steering vector: A1_mean vectors that are PLANTED on every positive and
zero on every negative, so the train DiffMean is PLANTED exactly. The export, /v1 and capability tests read their
steering vector from a run folder, and this is the store that run folder names."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from poolbench.corpus.passage import Passage
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.store.local import LocalStore

D = 32
PLANTED = np.array([3.0, -4.0] + [0.0] * (D - 2), np.float32)  # the train DiffMean; unit direction (0.6, -0.8, 0...)
POOLED_KEY = "pooled/praise"


def store_planted_table(store_root: Path, layers: Sequence[int] = (1,)) -> str:
    """Write concept 'praise' (4 train and 2 test matched pairs) pooled as PLANTED / zero at `layers` into a local
    store at `store_root`; the pooled key."""
    passages = [Passage(f"{split}-{i}-{label}", f"text {i} {label}", label, "d", 4, f"{split}-{i}", split, "praise")
                for i in range(6) for split in ["train" if i < 4 else "test"] for label in (1, 0)]
    vecs = np.zeros((len(passages), D), np.float32)
    vecs[[p.label == 1 for p in passages]] = PLANTED
    builder = PooledTableBuilder(passages, D)
    builder.add(np.stack([vecs[None]] * len(layers)), list(layers), ["A1_mean"], [p.id for p in passages],
                np.zeros(len(passages), bool))
    LocalStore(store_root).put_table(POOLED_KEY, builder.table())
    return POOLED_KEY
