"""export-submission writes what the public PoolBench leaderboard accepts: validated against its schema's rules."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from poolbench.errors import PoolBenchError
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.leaderboard import build_leaderboard
from poolbench.results.exports.submission import build_submission

SCHEMA = json.loads((Path(__file__).parent / "data" / "submission_schema.json").read_text())


def _cell(strategy: str, layer: int, test_auroc: float) -> D1CellRecord:
    return D1CellRecord(concept="hedging", layer=layer, strategy=strategy, probe="logistic", cv_auroc=test_auroc,
                        test_auroc=test_auroc, ci_low=test_auroc - 0.05, ci_high=min(1.0, test_auroc + 0.05))


@pytest.mark.parametrize("strategy,supervision,expected", [
    ("A1_mean", "none", "unsupervised"),
    ("S3_iti_probe", "labels", "supervised"),
])
@pytest.mark.parametrize("source", ["community", "published"])
def test_submission_validates_against_the_leaderboard_schema(strategy, supervision, expected, source):
    lb = build_leaderboard([_cell(strategy, 3, 0.82)])
    info = {"family": "uniform_aggregation" if strategy == "A1_mean" else "saliency_weighted",
            "supervision": supervision, "description": "a strategy described in more than ten characters"}
    doc = build_submission(lb, strategy, "mistral_7b", source, info).model_dump(mode="json")
    jsonschema.validate(doc, SCHEMA)
    assert doc["supervision"] == expected and doc["source"] == source
    assert doc["results"]["mistral_7b"]["layer"] == 3


def test_the_schema_rejects_what_the_old_export_wrote():
    """Our earlier export wrote supervision 'none' and source 'poolbench': the leaderboard refuses both."""
    lb = build_leaderboard([_cell("A1_mean", 0, 0.8)])
    info = {"family": "uniform_aggregation", "supervision": "none", "description": "mean over all real tokens"}
    doc = build_submission(lb, "A1_mean", "llama3_8b", "community", info).model_dump(mode="json")
    for field, bad in (("supervision", "none"), ("source", "poolbench")):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**doc, field: bad}, SCHEMA)


def test_an_unknown_source_is_one_line_naming_the_choices():
    lb = build_leaderboard([_cell("A1_mean", 0, 0.8)])
    info = {"family": "uniform_aggregation", "description": "mean over all real tokens"}
    with pytest.raises(PoolBenchError, match="--source must be one of community, published, got 'poolbench'"):
        build_submission(lb, "A1_mean", "llama3_8b", "poolbench", info)
