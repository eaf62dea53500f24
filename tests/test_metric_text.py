"""results.json's metric descriptions are rendered from the cells: each names the CI method and folds the cells
record, and no other."""

from __future__ import annotations

from poolbench.config import RunConfig
from poolbench.prober.auroc import AUROC_CI_METHOD
from poolbench.records.d1 import D1CellRecord
from poolbench.records.run import RunOutcome
from poolbench.results.documents.document import results_document
from poolbench.results.documents.metric_text import CI_METHOD_TEXT


def _cell(strategy: str, method: str | None, n_folds: int | None = 5) -> D1CellRecord:
    return D1CellRecord(concept="c", layer=2, strategy=strategy, probe="logistic", cv_auroc=0.8, test_auroc=0.7,
                        ci_low=0.6, ci_high=0.8, ci_level=0.95, ci_method=method, n_folds=n_folds)


def _document(records: list[D1CellRecord], n_folds: int = 5) -> dict:
    outcome = RunOutcome(config=RunConfig(steering=False, n_folds=n_folds), model={"model_id": "m"},
                         corpus={"hash": "h"}, layers=[2], strategies=[{"id": "A", "family": "f"}],
                         records=records, artifacts={})
    return results_document(outcome)


def test_the_d1_description_names_exactly_the_cells_ci_methods():
    document = _document([_cell("A", AUROC_CI_METHOD), _cell("B", AUROC_CI_METHOD)])
    text = document["metrics"]["d1"]
    for method in {cell["ci_method"] for cell in document["cells"]}:
        assert f"95% {CI_METHOD_TEXT[method]}" in text
    assert "ci = 95% pair-clustered DeLong (Obuchowski 1997) on the logit scale, Wilson at perfect separation" in text
    assert "bootstrap" not in text and "(5-fold," in text


def test_a_run_mixing_methods_names_both_and_an_old_cell_its_bootstrap():
    """Should-fail of the old fixed text: a cell without ci_method (an older run) used the bootstrap, and a run of
    3 folds says 3, not 5."""
    document = _document([_cell("A", AUROC_CI_METHOD, None), _cell("B", None, None)], n_folds=3)
    text = document["metrics"]["d1"]
    assert "(3-fold," in text
    assert text.endswith(f"ci = 95% {CI_METHOD_TEXT[None]}; 95% {CI_METHOD_TEXT[AUROC_CI_METHOD]}")
