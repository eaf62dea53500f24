"""RunOutcome: what a run produced, and everything results.json needs to say where it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from poolbench.config import RunConfig
from poolbench.records.breakdowns import BucketAurocRecord, LexicalTierRecord, TierAurocRecord
from poolbench.records.cluster import ClusterActivity
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.records.steering import SteeringStage


@dataclass
class RunOutcome:
    """What a run produced: cell records plus everything results.json needs to say where they came from."""

    config: RunConfig
    model: dict
    corpus: dict
    layers: list[int]
    strategies: list[dict]
    records: list[D1CellRecord]
    artifacts: dict[str, dict[str, str]]
    computed: dict[str, int] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    store: str = ""
    steering: SteeringStage | None = None
    steering_error: str = ""  # the one line that failed the steering stage (the D1 results stand)
    lexical: list[LexicalBaselineRecord] = field(default_factory=list)
    d1_buckets: list[BucketAurocRecord] = field(default_factory=list)
    d1_tiers: list[TierAurocRecord] = field(default_factory=list)
    lexical_tiers: list[LexicalTierRecord] = field(default_factory=list)
    cluster: ClusterActivity = field(default_factory=ClusterActivity)
    passage_scores: pa.Table | None = None  # every D1 cell's per-passage scores (poolbench.prober.passage_scores)
    steerability: dict | None = None  # driver.steerability_stage: first-order steerability and Spearman with D1
    axis_records: list[D1CellRecord] = field(default_factory=list)  # D1 cells at other sites / context lengths
    axis_artifacts: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)  # variant -> concept -> keys
