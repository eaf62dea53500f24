"""The HTTP API's request and response bodies: pydantic models that refuse unknown fields, NaN and Infinity, so a
handler only sees a request it can answer."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

Text = Annotated[str, StringConstraints(min_length=1)]
_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity are valid JSON to Python, not to us


class PoolRequest(BaseModel):
    model_config = _REQUEST
    model: str = Field("embedded", description="a model this service serves (see /healthz)")
    layer: int = Field(ge=0, description="hook point layers.{layer}.out")
    strategy: str = Field("A1_mean", description="strategy id or short code; unsupervised, no corpus statistics")
    texts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")


class LabelledText(BaseModel):
    model_config = _REQUEST
    text: Text = Field(description="at most max_chars characters")
    label: int = Field(ge=0, le=1)
    split: str = Field(pattern="^(train|test)$")
    group: str | None = Field(None, description="matched_pair_id: a pair stays in one fold, resamples together")


class ProbeRequest(BaseModel):
    model_config = _REQUEST
    model: str = "embedded"
    layer: int = Field(ge=0)
    strategy: str = "A1_mean"
    items: list[LabelledText] = Field(min_length=4, description="at most max_texts; both labels in both splits")
    n_folds: int = Field(5, ge=2, le=10)
    seed: int = 0
    n_bootstrap: int = Field(1000, ge=0, description="at most max_bootstrap")

    @model_validator(mode="after")
    def _both_classes_in_both_splits(self) -> ProbeRequest:
        for split in ("train", "test"):
            labels = {i.label for i in self.items if i.split == split}
            if labels != {0, 1}:
                raise ValueError(f"items: the {split} split needs both labels 0 and 1, has {sorted(labels)}")
        return self


class ScoreRequest(BaseModel):
    model_config = _REQUEST
    concept: str = Field(description="a concept this service has a scorer for (see /healthz)")
    texts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")


class StoredVector(BaseModel):
    """A steering vector of the run this service was started with: the DiffMean of the run's pooled train vectors
    of `concept` under `strategy` at the request's `layer`, as the run's D2 stage builds it."""

    model_config = _REQUEST
    concept: str = Field(description="a concept of the run (see /healthz vectors)")
    strategy: str = Field("A1_mean", description="strategy id or short code the run pooled with")
    unit: Literal["residual", "raw"] = Field(
        "residual", description="residual: alpha in units of the layer's mean token residual norm, D2's alpha "
                                "(needs a D2 cell of the run at this concept and layer); raw: alpha times the "
                                "DiffMean vector itself")


class GenerateRequest(BaseModel):
    model_config = _REQUEST
    model: str = "embedded"
    prompts: list[Text] = Field(min_length=1, description="at most max_texts, each at most max_chars characters")
    layer: int = Field(ge=0, description="the decoder layer whose output alpha * vector is added to")
    vector: list[float] | None = Field(None, description="a raw steering vector, hidden_size finite floats, added "
                                                         "as alpha * vector; null (and no stored): unsteered")
    stored: StoredVector | None = Field(None, description="or a stored vector of the service's run, by (concept, "
                                                          "strategy) at `layer`; not with `vector`")
    alpha: float = Field(0.0, description="finite; 0 or no vector: unsteered")
    max_new_tokens: int = Field(16, ge=1, description="at most max_new_tokens")
    temperature: float = Field(0.7, gt=0)
    greedy: bool = False
    seed: int = Field(0, description="prompt i samples with seed + i, whatever else is in the batch")

    @model_validator(mode="after")
    def _one_vector(self) -> GenerateRequest:
        if self.vector is not None and self.stored is not None:
            raise ValueError("give either vector (raw) or stored (a run's vector), not both")
        return self


class PoolResponse(BaseModel):
    model_id: str
    layer: int
    strategy: str
    dim: int
    vectors: list[list[float]] = Field(description="one pooled vector per text, in input order")
    fallback: list[bool] = Field(description="True where the strategy selected no token and fell back to A1")
    seconds: float


class ProbeScores(BaseModel):
    probe: str
    cv_auroc: float | None
    test_auroc: float | None
    ci_low: float | None
    ci_high: float | None
    ci_level: float | None
    n_train: int
    n_test: int
    fallback_rate: float


class ProbeResponse(BaseModel):
    model_id: str
    layer: int
    strategy: str
    probes: dict[str, ProbeScores] = Field(description="by probe name: logistic and diffmean")
    seconds: float


class ScoreResponse(BaseModel):
    concept: str
    scores: list[float] = Field(description="classifier B's P(concept | text) in [0, 1], one per text, in input "
                                            "order")
    heldout_auroc: float | None = Field(description="the scorer's AUROC on its concept's held-out split")


class GenerationOut(BaseModel):
    prompt: str
    text: str


class GenerateResponse(BaseModel):
    model_id: str
    layer: int
    alpha: float
    generations: list[GenerationOut]


class Health(BaseModel):
    status: str
    models: list[str]
    scorers: list[str]
    vectors: list[str] = Field(description="concepts whose stored vectors /generate can steer with")
