"""Per-passage score tables made by hand, as a run stores them (prober.passage_scores): readings that take the
held-out scores as given (tiers, buckets) are tested on scores chosen to give a known AUROC."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from poolbench.corpus.passage import Passage
from poolbench.prober.passage_scores import HELDOUT, cell_scores_table, concat_scores


def stored_heldout_scores(passages: Sequence[Passage], by_strategy: Mapping[str, Sequence[float]], *, layer: int = 0,
                          probe: str = "logistic") -> pa.Table:
    """The held-out rows a run would store for one concept: each strategy's score of each test passage
    (`by_strategy[s][i]` belongs to passages[i]; train passages' scores are ignored)."""
    test = [i for i, p in enumerate(passages) if p.split == "test"]
    ids = np.array([passages[i].id for i in test])
    pairs = np.array([passages[i].matched_pair_id or passages[i].id for i in test])
    labels = np.array([passages[i].label for i in test])
    tiers = {passages[i].id: passages[i].tier for i in test}
    return concat_scores([
        cell_scores_table(passages[0].concept, layer, strategy, probe, HELDOUT, ids, pairs, labels,
                          np.asarray(values, dtype=np.float64)[test], tiers=tiers)
        for strategy, values in by_strategy.items()])
