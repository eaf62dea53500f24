"""results.json's `metrics` descriptions, rendered from what the cells record they ran (fold count, CI level and
method), so the text cannot drift from the numbers it describes."""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.prober.auroc import AUROC_CI_METHOD
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord

# A cell's ci_method -> what the interval is. None: runs before ci_method was recorded, which used the bootstrap.
CI_METHOD_TEXT: dict[str | None, str] = {
    AUROC_CI_METHOD: "pair-clustered DeLong (Obuchowski 1997) on the logit scale, Wilson at perfect separation",
    None: "pair-grouped percentile bootstrap",
}


def ci_text(records: Sequence[D1CellRecord] | Sequence[LexicalBaselineRecord]) -> str:
    """'95% <method>' for each (level, method) the records carry, joined by '; ' when a run mixes them."""
    kinds = sorted({(float(r.ci_level) if r.ci_level is not None else 0.95, r.ci_method) for r in records},
                   key=lambda kind: (kind[0], kind[1] or ""))
    return "; ".join(f"{level:.0%} {CI_METHOD_TEXT.get(method, method or '')}" for level, method in kinds)


def d1_description(records: Sequence[D1CellRecord], n_folds: int) -> str:
    """metrics.d1: the folds the cells report (the config's where a cell predates n_folds) and their CI."""
    folds = sorted({r.n_folds or n_folds for r in records}) or [n_folds]
    return (f"probe AUROC: cv_auroc = out-of-fold on train ({'/'.join(map(str, folds))}-fold, grouped by "
            f"matched_pair_id); test_auroc = fit on train, scored on the held-out split; ci = {ci_text(records)}")


def metric_descriptions(records: Sequence[D1CellRecord], lexical: Sequence[LexicalBaselineRecord],
                        n_folds: int) -> dict[str, str]:
    """The `metrics` section: D1 always, the lexical baseline's interval when the run computed it."""
    out = {"d1": d1_description(records, n_folds)}
    if lexical:
        out["lexical_baseline"] = (f"TF-IDF bag-of-words logistic AUROC, fit on train, scored on the held-out split; "
                                   f"ci = {ci_text(lexical)}")
    return out
