"""Per-passage scores are an artifact, not a log: every D1 cell keeps the held-out and out-of-fold scores of the
fit it reported (passage id, pair id, label, tier), as an Arrow table keyed like the cell's D1 artifact. Paired
tests, the answer, `--log-samples` and the report read this table; nothing refits to explain a number."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from poolbench.prober.auroc import ProbeError
from poolbench.store.keys import artifact_key

HELDOUT = "heldout"  # the all-train fit scored on the test split: what test_auroc is computed from
OUT_OF_FOLD = "oof"  # each train passage scored by the CV fold model that did not see it: cv_auroc's input
NO_FOLD = -1

PASSAGE_SCORES_SCHEMA = pa.schema([
    ("concept", pa.string()), ("layer", pa.int32()), ("strategy", pa.string()), ("probe", pa.string()),
    ("kind", pa.string()), ("fold", pa.int16()), ("passage_id", pa.string()), ("pair_id", pa.string()),
    ("label", pa.int8()), ("tier", pa.string()), ("score", pa.float64()),
])


@dataclass(frozen=True)
class PassageScore:
    """One passage's decision score in one D1 cell: `kind` is HELDOUT or OUT_OF_FOLD, `fold` the CV fold that
    scored it (NO_FOLD for held-out scores), `tier` None where the corpus declares none."""

    concept: str
    layer: int
    strategy: str
    probe: str
    kind: str
    fold: int
    passage_id: str
    pair_id: str
    label: int
    tier: str | None
    score: float


def passage_scores_key(d1_key: str) -> str:
    """The per-passage score table that belongs to a D1 artifact (or to one of its layer shards)."""
    return artifact_key("passage_scores", of=d1_key)


def cell_scores_table(concept: str, layer: int, strategy: str, probe: str, kind: str, passage_ids: np.ndarray,
                      pair_ids: np.ndarray, labels: np.ndarray, scores: np.ndarray, *,
                      folds: np.ndarray | None = None, tiers: Mapping[str, str | None] | None = None) -> pa.Table:
    """One cell's scores of one kind, column by column (a cell holds tens of passages; a run a few 100 k)."""
    n = len(passage_ids)
    if not (len(pair_ids) == len(labels) == len(scores) == n) or (folds is not None and len(folds) != n):
        raise ProbeError(f"passage scores of {concept} / {strategy} layer {layer}: {n} passages but "
                         f"{len(scores)} scores")
    ids = [str(p) for p in passage_ids]
    return pa.table({
        "concept": pa.array([concept] * n, pa.string()), "layer": pa.array([int(layer)] * n, pa.int32()),
        "strategy": pa.array([strategy] * n, pa.string()), "probe": pa.array([probe] * n, pa.string()),
        "kind": pa.array([kind] * n, pa.string()),
        "fold": pa.array(np.full(n, NO_FOLD) if folds is None else np.asarray(folds), pa.int16()),
        "passage_id": pa.array(ids, pa.string()), "pair_id": pa.array([str(g) for g in pair_ids], pa.string()),
        "label": pa.array(np.asarray(labels), pa.int8()),
        "tier": pa.array([(tiers or {}).get(p) for p in ids], pa.string()),
        "score": pa.array(np.asarray(scores, dtype=np.float64), pa.float64()),
    }, schema=PASSAGE_SCORES_SCHEMA)


def concat_scores(tables: Sequence[pa.Table]) -> pa.Table:
    """Many cells' tables as one, each column in one piece (an empty table with the schema when there are none).

    One piece, not one per cell: a table of thousands of cells is written as thousands of Arrow record batches,
    each with its own metadata and, zstd-compressed in the run folder, its own compression frame. make run's
    7,752 batches took 2.4 s to write and 2.3 s to read back there (18.1 MB), one batch 0.03 and 0.01 s (7.1 MB).
    Where a string column would pass Arrow's 2 GiB offsets in one piece (no run holds such ids), the pieces stay."""
    if not tables:
        return PASSAGE_SCORES_SCHEMA.empty_table()
    joined = pa.concat_tables(tables)
    try:
        return joined.combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowCapacityError):  # offsets past 2 GiB in one string column
        return joined


def passage_scores_of(table: pa.Table) -> list[PassageScore]:
    """The typed rows of a stored table; a table missing a column stops in one line naming it."""
    missing = [name for name in PASSAGE_SCORES_SCHEMA.names if name not in table.column_names]
    if missing:
        raise ProbeError(f"passage score table lacks column(s) {', '.join(missing)}")
    return [PassageScore(**row) for row in table.select(PASSAGE_SCORES_SCHEMA.names).to_pylist()]


@dataclass(frozen=True)
class HeldOutCell:
    """One concept's held-out scores of one (strategy, layer, probe), rows sorted by passage id so that two
    strategies' cells of the same concept line up passage by passage."""

    passage_ids: np.ndarray
    pair_ids: np.ndarray
    labels: np.ndarray
    scores: np.ndarray


def held_out_cells(table: pa.Table, chosen: Mapping[str, int], probe: str) -> dict[tuple[str, str], HeldOutCell]:
    """(concept, strategy) -> its held-out scores at the layer `chosen` names for the strategy."""
    # Arrow keeps the probe's held-out rows before any column leaves it: a run's table holds every layer, both
    # probes and the out-of-fold rows (~2.4 M rows at the full corpus), and its strings become Python objects
    # on the way to numpy.
    table = table.filter(pc.and_(pc.equal(table.column("kind"), HELDOUT), pc.equal(table.column("probe"), probe)))
    cols = {name: table.column(name).to_numpy(zero_copy_only=False)
            for name in ("concept", "layer", "strategy", "passage_id", "pair_id", "label", "score")}
    layer_of = np.array([chosen.get(str(s), -10**6) for s in cols["strategy"]], dtype=np.int64)
    keep = cols["layer"] == layer_of
    out: dict[tuple[str, str], HeldOutCell] = {}
    groups: dict[tuple[str, str], list[int]] = {}
    for i in np.flatnonzero(keep):
        groups.setdefault((str(cols["concept"][i]), str(cols["strategy"][i])), []).append(int(i))
    for key, members in groups.items():
        idx = np.asarray(members)
        idx = idx[np.argsort(cols["passage_id"][idx], kind="stable")]
        out[key] = HeldOutCell(cols["passage_id"][idx].astype(str), cols["pair_id"][idx].astype(str),
                               cols["label"][idx].astype(np.int64), cols["score"][idx].astype(np.float64))
    return out
