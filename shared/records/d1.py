"""D1CellRecord: one (concept, layer, strategy, probe) cell of D1 with its reliability columns."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from poolbench.records.base import Number, Record


class D1CellRecord(Record):
    """A D1 cell as results.json carries it; reliability columns are absent when the run skipped them and
    None on cells where they are undefined (the diffmean probe, supervised cells)."""

    concept: str
    layer: int
    strategy: str
    probe: str
    cv_auroc: Number
    cv_fold_aurocs: list[Number] | None = None
    test_auroc: Number
    ci_low: Number
    ci_high: Number
    ci_level: Number | None = None
    ci_method: str | None = None  # absent: older runs, a pair-bootstrap percentile interval
    ci_degenerate: bool | None = None  # perfect separation: the CI comes from the worst-case variance bound
    n_train: int | None = None
    n_test: int | None = None
    n_folds: int | None = None
    n_bootstrap: int | None = None
    fallback_count: int | None = None
    fallback_rate: Number = 0.0  # cells that predate fallback counting fell back nowhere
    heads_selected: list[int] | None = None
    reliability_probe: str | None = None
    seed_cv_aurocs: list[Number] | None = None
    seed_mean: Number | None = None
    seed_std: Number | None = None
    selectivity: Number | None = None
    control_cv_auroc: Number | None = None
    control_ci_low: Number | None = None
    control_ci_high: Number | None = None
    control_task: str | None = None  # absent: v2's pair-label control with twins split across folds
    selectivity_na_reason: str | None = None  # why selectivity is None (no lexical types recurring across pairs)
    mdl_compression: Number | None = None
    mdl_online_bits: Number | None = None
    mdl_uniform_bits: Number | None = None
    mdl_block_ends: list[int] | None = None
    mdl_block_bits: list[Number] | None = None
    mdl_na_reason: str | None = None  # why mdl_compression is None (too few blocks for a prequential code)
    # the D1 protocol: absent = PoolBench's (pair-grouped CV, held-out test); "pb" = the reference leaderboard's
    # (train split only, 5-fold OOF DiffMean AUROC, no held-out test: test_auroc then holds that OOF AUROC too)
    protocol: str | None = None
    # the cell axes beside layers (driver.variants): absent on the run's main cells (the block output, length 1)
    site: str | None = None  # "residual", "attn" or "mlp": the activation site pooled
    context_length: int | None = None  # test passages read inside k x their length of neutral text; trained at 1


def d1_records_table(records: list[D1CellRecord]) -> pa.Table:
    """Every row gets every column (Arrow infers a schema from the first row and would drop later keys)."""
    rows = [r.to_dict() for r in records]
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return pa.Table.from_pylist([{key: row.get(key) for key in keys} for row in rows])


def d1_records_from_table(table: pa.Table) -> list[D1CellRecord]:
    """The D1 records of a stored Arrow artifact, one per row."""
    return [D1CellRecord.from_dict(row) for row in table.to_pylist()]


def choose_on_cv(cv_means: Mapping[str, float]) -> str:
    """The best strategy by mean out-of-fold AUROC (training data only); ties go to the first name. PoolBench's one
    rule for "the best": the answer's verdicts, the leaderboard, steering's best cell and the API all call it."""
    if not cv_means:
        raise ValueError("choose_on_cv: no strategies")
    return min(cv_means, key=lambda s: (-cv_means[s], s))


def cv_best_row(rows: list[dict]) -> dict:
    """The leaderboard row of the strategy chosen on training CV alone (`choose_on_cv`; a row without a CV mean
    competes with its mean D1). Steering's "best" cell, the printed summary and the Python API read the same row, so
    none of them picks the run's best on the held-out test it is then judged on."""
    by_name = {r["strategy"]: r for r in rows}
    return by_name[choose_on_cv({name: r.get("mean_cv_auroc", r["mean_d1"]) for name, r in by_name.items()})]
