"""Typed records: a record the code produced goes dict -> record -> dict unchanged (keys, order, values), and
a malformed dict is refused in one line naming the record type and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from record_samples import d2_record, scorer_validity

from poolbench.corpus.passage import Passage
from poolbench.errors import PoolBenchError
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.prober.concept_probe import probe_pooled_table
from poolbench.records.base import RecordError
from poolbench.records.d1 import D1CellRecord, d1_records_from_table, d1_records_table
from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record, D3Record, SteeringResult

D1_KEYS = ["concept", "layer", "strategy", "probe", "cv_auroc", "cv_fold_aurocs", "test_auroc", "ci_low", "ci_high",
           "ci_level", "ci_method", "ci_degenerate", "n_train", "n_test", "n_folds", "n_bootstrap", "fallback_count",
           "fallback_rate", "heads_selected"]
RELIABILITY_KEYS = ["reliability_probe", "seed_cv_aurocs", "seed_mean", "seed_std", "selectivity",
                    "control_cv_auroc", "control_ci_low", "control_ci_high", "control_task",
                    "selectivity_na_reason", "mdl_compression", "mdl_online_bits", "mdl_uniform_bits",
                    "mdl_block_ends", "mdl_block_bits", "mdl_na_reason"]


def pooled_table():
    """Two strategies at layer 3 on 12 train and 6 test matched pairs; P1 falls back on the first 4 passages."""
    passages = [Passage(f"{split}-{i}-{label}", "text", label, "d", 4, f"{split}-{i}", split, "c")
                for split, n in (("train", 12), ("test", 6)) for i in range(n) for label in (1, 0)]
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(1, 2, len(passages), 5))
    vectors[0, :, :, 0] += 1.5 * np.array([p.label for p in passages])
    fallback = np.zeros((2, len(passages)), bool)
    fallback[1, :4] = True
    builder = PooledTableBuilder(passages, 5)
    builder.add(vectors, [3], ["A1_mean", "P1_last"], [p.id for p in passages], fallback)
    return builder.table()


@pytest.fixture(scope="module")
def d1_records() -> list[D1CellRecord]:
    return probe_pooled_table(pooled_table(), "c", n_folds=3, n_bootstrap=50)


def test_d1_record_round_trip_through_dict_and_the_stored_arrow_table(d1_records):
    assert [(r.strategy, r.probe) for r in d1_records] == [("A1_mean", "logistic"), ("A1_mean", "diffmean"),
                                                           ("P1_last", "logistic"), ("P1_last", "diffmean")]
    p1 = d1_records[2]
    assert p1.layer == 3 and p1.fallback_count == 4 and p1.fallback_rate == 4 / 36 and p1.heads_selected is None
    assert p1.n_train == 24 and p1.n_test == 12 and p1.n_folds == 3 and p1.n_bootstrap == 50
    assert p1.reliability_probe == "logistic" and d1_records[3].seed_mean is None  # diffmean: not defined
    for record in d1_records:
        written = record.to_dict()
        assert list(written) == D1_KEYS + RELIABILITY_KEYS
        assert json.dumps(D1CellRecord.from_dict(json.loads(json.dumps(written))).to_dict()) == json.dumps(written)
    back = d1_records_from_table(d1_records_table(d1_records))
    assert back == d1_records and [r.to_dict() for r in back] == [r.to_dict() for r in d1_records]


def test_d1_record_without_reliability_leaves_those_keys_out():
    records = probe_pooled_table(pooled_table(), "c", n_folds=3, n_bootstrap=20, reliability=False)
    table = d1_records_table(records)
    assert table.column_names == D1_KEYS
    assert [list(r.to_dict()) for r in d1_records_from_table(table)] == [D1_KEYS] * 4


def test_arrow_table_gives_every_row_every_column():
    """A cell without reliability columns (a supervised one) beside one with them: None in the table, not absent."""
    plain = {"concept": "c", "layer": 0, "strategy": "S3_iti_probe", "probe": "logistic", "cv_auroc": 0.7,
             "test_auroc": 0.75, "ci_low": 0.6, "ci_high": 0.9, "heads_selected": [1, 3]}
    full = {**plain, "strategy": "A1_mean", "heads_selected": None, "seed_mean": 0.71}
    table = d1_records_table([D1CellRecord.from_dict(plain), D1CellRecord.from_dict(full)])
    assert table.to_pylist()[0] == {**plain, "seed_mean": None}
    assert d1_records_from_table(table)[0].heads_selected == [1, 3]


def test_steering_records_round_trip_key_for_key():
    per_alpha = [{"alpha": 0.0, "score": 0.2, "perplexity": 3.0, "fluency_ratio": 1.0, "relevance": 0.4,
                  "fluency01": 1.0, "hm": 0.4},
                 {"alpha": 1.0, "score": 0.5, "perplexity": None, "fluency_ratio": None, "relevance": 0.3,
                  "fluency01": 0.0, "hm": 0.0}]
    d2 = d2_record(scp_ci_low=0.1, scp_ci_high=0.8, fluency_guard=2, per_alpha=per_alpha, seconds=1.5,
                   generations_key="generations/x").selected("best D1")
    d3 = {"concept": "a", "strategy": "A1_mean", "layer": 0, "model_id": "tiny", "backend": "transformers",
          "neighbour": "b", "relation": "LC", "alpha_star": 1.0, "delta_a": 0.3, "delta_a_ci_low": 0.1,
          "delta_a_ci_high": 0.5, "delta_b": None, "disent": None, "disent_raw": None,
          "disent_null_reason": "no scorer for neighbour 'b'", "d3_rep": 0.25,
          "neighbour_vector_null_reason": None}
    stored = {"d2": d2.to_dict(), "d3": [d3], "key": "steering/x"}
    result = SteeringResult.from_dict(json.loads(json.dumps(stored)))
    assert json.dumps(result.to_dict()) == json.dumps(stored)
    assert result.d2.fluency_guard == 2 and isinstance(result.d2.fluency_guard, int)  # an int stays an int
    assert result.d2.per_alpha[1].perplexity is None and result.d3[0].delta_b_ci_low is None
    assert "delta_b_ci_low" not in result.to_dict()["d3"][0]
    assert isinstance(result.d3[0], D3Record) and result.d2.selected_because == "best D1"


def test_scorer_validity_round_trip():
    record = scorer_validity(heldout_auroc_ci_low=None)
    assert ScorerValidity.from_dict(record.to_dict()) == record and record.to_dict()["heldout_auroc_ci_low"] is None


@pytest.mark.parametrize("record,data,message", [
    (D1CellRecord, {"concept": "c", "layer": "two", "strategy": "A1_mean", "probe": "logistic", "cv_auroc": 0.7,
                    "test_auroc": 0.7, "ci_low": 0.6, "ci_high": 0.8},
     "D1CellRecord: field 'layer': Input should be a valid integer (got 'two')"),
    (D1CellRecord, {"concept": "c", "layer": 0, "strategy": "A1_mean", "probe": "logistic", "cv_auroc": "0.7",
                    "test_auroc": 0.7, "ci_low": 0.6, "ci_high": 0.8},
     "D1CellRecord: field 'cv_auroc': Input should be a valid number (got '0.7')"),
    (D1CellRecord, {"concept": "c", "layer": 0, "strategy": "A1_mean", "probe": "logistic", "cv_auroc": 0.7,
                    "ci_low": 0.6, "ci_high": 0.8},
     "D1CellRecord: field 'test_auroc': Field required"),
    (D2Record, {**d2_record().to_dict(), "status": "maybe"},
     "D2Record: field 'status': Input should be 'ok' or 'null' (got 'maybe')"),
    (D2Record, {k: v for k, v in d2_record().to_dict().items() if k != "scp"},
     "D2Record: field 'scp': Field required"),
    (D2Record, {**d2_record().to_dict(), "scp_typo": 0.1},
     "D2Record: field 'scp_typo': Extra inputs are not permitted (got 0.1)"),
    (ScorerValidity, {**scorer_validity().to_dict(), "valid": "yes"},
     "ScorerValidity: field 'valid': Input should be a valid boolean (got 'yes')"),
])
def test_a_malformed_record_is_refused_in_one_line(record, data, message):
    with pytest.raises(RecordError) as err:
        record.from_dict(data)
    assert str(err.value) == message
    assert isinstance(err.value, PoolBenchError) and "\n" not in str(err.value)
