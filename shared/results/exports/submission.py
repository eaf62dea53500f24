"""The PoolBench community-submission format, validated with pydantic before anything is written."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from poolbench.defaults import DEFAULT_PROTOCOL, PB_PROTOCOL
from poolbench.errors import PoolBenchError

MODEL_KEYS = ("llama3_8b", "gemma2_9b", "mistral_7b", "qwen25_7b", "flan_t5_xl", "mamba2_2b", "bert_base")
Family = Literal["position_anchored", "uniform_aggregation", "window", "saliency_weighted",
                 "structural_linguistic", "oracle", "other"]
Source = Literal["community", "published"]  # 'published' only for a direct implementation of a prior paper
SOURCES = ("community", "published")
# A StrategySpec's supervision ('labels' = fitted on the concept's train labels) in the leaderboard's words.
SUPERVISION_NAMES = {"none": "unsupervised", "labels": "supervised"}
DESCRIPTION_MIN, DESCRIPTION_MAX = 10, 500


class ConceptScore(BaseModel):
    model_config = ConfigDict(extra="forbid")
    auroc: float = Field(ge=0.0, le=1.0)
    ci_low: float = Field(ge=0.0, le=1.0)
    ci_high: float = Field(ge=0.0, le=1.0)


class ModelResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mean_auroc: float = Field(ge=0.0, le=1.0)
    per_concept: dict[str, ConceptScore]
    layer: int = Field(ge=0)


class Submission(BaseModel):
    """One strategy's results, keyed by the leaderboard's model keys."""

    model_config = ConfigDict(extra="forbid")
    strategy_id: str = Field(pattern=r"^[A-Z0-9]+_[a-z0-9_]+$")
    family: Family
    supervision: Literal["unsupervised", "supervised"]
    source: Source
    description: str = Field(min_length=DESCRIPTION_MIN, max_length=DESCRIPTION_MAX)
    results: dict[Literal[MODEL_KEYS], ModelResult]  # type: ignore[valid-type]


LEADERBOARD_PROTOCOL = PB_PROTOCOL  # the official leaderboard's D1 protocol (poolbench.prober.pb_protocol)
OTHER_PROTOCOL_NOTE = ("[D1 here is PoolBench's protocol '{protocol}' (pair-grouped CV layer choice, held-out "
                       "logistic-probe AUROC), not the leaderboard's 'pb'] ")


def leaderboard_protocol(leaderboard: dict) -> str:
    """The D1 protocol of a leaderboard.json: boards written before protocols were recorded are PoolBench's."""
    return str(leaderboard.get("protocol") or DEFAULT_PROTOCOL)


def check_protocol(leaderboard: dict, where: str, allow_other: bool) -> str:
    """The board's protocol; refuses (one line naming the fix) to go on with a non-pb D1 unless `allow_other`."""
    protocol = leaderboard_protocol(leaderboard)
    if protocol != LEADERBOARD_PROTOCOL and not allow_other:
        raise PoolBenchError(f"{where}: D1 was computed under protocol '{protocol}', not the official leaderboard's "
                             f"'pb'; rerun with `--protocol pb`, or pass --allow-other-protocol to submit it labelled")
    return protocol


def build_submission(leaderboard: dict, strategy: str, model_key: str, source: str,
                     strategy_info: dict) -> Submission:
    """Take one strategy's row of a leaderboard; errors name the strategy or model key. A board of another
    protocol than pb says so at the head of the description (the schema has no field for it)."""
    if source not in SOURCES:
        raise PoolBenchError(f"--source must be one of {', '.join(SOURCES)}, got '{source}'")
    if model_key not in MODEL_KEYS:
        raise PoolBenchError(f"unknown model key '{model_key}' (known: {', '.join(MODEL_KEYS)})")
    row = next((r for r in leaderboard["strategies"] if r["strategy"] == strategy), None)
    if row is None:
        known = ", ".join(r["strategy"] for r in leaderboard["strategies"])
        raise PoolBenchError(f"strategy '{strategy}' is not in the leaderboard (present: {known})")
    per_concept = {c: ConceptScore(auroc=v["auroc"], ci_low=v["ci_low"], ci_high=v["ci_high"])
                   for c, v in row["per_concept"].items()}
    return Submission(
        strategy_id=strategy,
        family=strategy_info["family"],
        supervision=SUPERVISION_NAMES[strategy_info.get("supervision", "none")],
        source=source,
        description=_description(strategy_info["description"], leaderboard_protocol(leaderboard)),
        results={model_key: ModelResult(mean_auroc=row["mean_d1"], per_concept=per_concept,
                                        layer=row["best_layer"])},
    )


def _description(description: str, protocol: str) -> str:
    if protocol == LEADERBOARD_PROTOCOL or len(description) < DESCRIPTION_MIN:
        return description  # a description the schema refuses stays refused, labelled or not
    note = OTHER_PROTOCOL_NOTE.format(protocol=protocol)
    return note + description[:DESCRIPTION_MAX - len(note)]


def protocol_sidecar(leaderboard: dict, strategy: str, model_key: str) -> dict:
    """What a submission_<strategy>.protocol.json beside the submission says about its D1."""
    protocol = leaderboard_protocol(leaderboard)
    return {"strategy_id": strategy, "model_key": model_key, "protocol": protocol,
            "leaderboard_protocol": LEADERBOARD_PROTOCOL, "comparable": protocol == LEADERBOARD_PROTOCOL,
            "layer_selection": leaderboard.get("layer_selection")}
