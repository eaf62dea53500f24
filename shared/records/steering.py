"""D2 and D3 records: one steering cell's effect (D2) and its effect on each neighbour concept (D3).

Keys a cell did not reach (a null steering vector has no alpha table; a run without the prompted baseline
has no prompted_* keys) are absent, not None, exactly as the stored artifact and results.json hold them.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from poolbench.records.base import Number, Record
from poolbench.records.scorer import ScorerValidity


class AlphaRow(Record):
    """One alpha of one half (report or selection): mean score, perplexity and its ratio to alpha = 0, relevance,
    their [0, 1] forms' harmonic mean."""

    alpha: Number
    score: Number
    perplexity: Number | None  # under the reference model, unconditioned on the prompt (D2 v4; before: after it)
    fluency_ratio: Number | None
    distinct_2: Number | None = None  # mean distinct-2 of the continuations (absent before D2 v4)
    relevance: Number
    fluency01: Number
    hm: Number


class D2Record(Record):
    """One (concept, strategy, layer) steering cell: the vector, SCP, alpha* and Delta(alpha*) beside the prompted
    baseline; status 'null' (with null_reason) when the steering vector vanished."""

    concept: str
    strategy: str
    layer: int
    model_id: str
    backend: str
    vector_norm: Number
    residual_norm: Number | None
    vector_null_reason: str | None
    n_prompts: int
    alphas: list[Number]
    scorer_key: str | None
    scorer_heldout_auroc: Number | None
    prompt_format: Literal["chat", "plain"] | None = None  # how prompts reached the model (absent: older runs)
    gen_max_new_tokens: int
    gen_min_new_tokens: int
    gen_temperature: Number
    gen_greedy: bool
    status: Literal["ok", "null"]
    null_reason: str | None
    scp: Number | None
    scp_ci_low: Number | None = None
    scp_ci_high: Number | None = None
    scp_n_generations: int | None = None
    scp_n_bootstrap: int | None = None
    scp_degenerate_replicates: int | None = None  # constant resamples, kept as rho = 0 (never dropped)
    alpha_star: Number | None = None
    alpha_star_index: int | None = None
    # chosen | no_alpha_helps (alpha* > 0 did not beat alpha = 0 on the selection half) | no_alpha_fluent (none
    # passed the guard; alpha* = 0); absent in runs before D2 v3, where alpha = 0 was a candidate
    alpha_star_outcome: Literal["chosen", "no_alpha_helps", "no_alpha_fluent"] | None = None
    alpha_star_counts: dict[str, int] | None = None  # alpha* over resampled halvings ("none": no fluent alpha)
    alpha_star_stability: Number | None = None  # share of those halvings agreeing with the reported choice
    n_halvings: int | None = None
    d2_delta: Number | None
    d2_delta_ci_low: Number | None = None
    d2_delta_ci_high: Number | None = None
    score_at_alpha_star: Number | None = None
    score_at_zero: Number | None = None
    fluency_ratio: Number | None = None
    fluency_guard: Number | None = None
    distinct_2: Number | None = None  # at alpha*, on the report half (absent before D2 v4)
    min_distinct_2: Number | None = None  # the guard's distinct-2 floor
    passes_fluency_guard: bool | None = None  # alpha*'s continuations on the report half pass the guard
    reference_model: str | None = None  # the model that judged fluency (absent before D2 v4: the steered model)
    fluency_measure: str | None = None
    relevance: Number | None = None
    perplexity_at_zero: Number | None = None
    select_prompts: list[int] | None = None
    report_prompts: list[int] | None = None
    per_alpha: list[AlphaRow] | None = None
    per_alpha_select: list[AlphaRow] | None = None  # the selection half's rows alpha* was chosen on
    prompted_instruction: str | None = None
    prompted_score: Number | None = None
    prompted_delta: Number | None = None
    prompted_delta_ci_low: Number | None = None
    prompted_delta_ci_high: Number | None = None
    prompted_fluency_ratio: Number | None = None
    prompted_relevance: Number | None = None
    prompted_distinct_2: Number | None = None
    prompted_passes_fluency_guard: bool | None = None  # the guard steering's alpha must pass, applied to prompting
    seconds: Number | None = None
    generations_key: str | None = None
    selected_because: str | None = None

    def selected(self, because: str) -> D2Record:
        """This record with the reason the run chose its cell (best D1, worst D1, full)."""
        return self.model_copy(update={"selected_because": because})


class D3Record(Record):
    """Steering toward `concept` seen by a neighbour's scorer: Disent = 1 - Delta_B / Delta_A (clipped, raw kept),
    None with a reason when undefined, and D3_rep, the cosine of the two concepts' steering vectors."""

    concept: str
    strategy: str
    layer: int
    model_id: str
    backend: str
    neighbour: str
    relation: str
    alpha_star: Number | None = None
    delta_a: Number | None = None
    delta_a_ci_low: Number | None = None
    delta_a_ci_high: Number | None = None
    delta_b: Number | None = None
    delta_b_ci_low: Number | None = None
    delta_b_ci_high: Number | None = None
    disent: Number | None
    disent_raw: Number | None
    disent_null_reason: str | None
    d3_rep: Number | None
    d3_rep_massive_share: Number | None = None  # the larger of the two vectors' top-3 share of the squared norm
    d3_rep_massive_dims: list[int] | None = None
    d3_rep_massive: bool | None = None  # share > 0.5: D3_rep compares a few massive dimensions, not concepts
    d3_rep_without_massive: Number | None = None  # the cosine with those dimensions (both vectors' top 3) removed
    neighbour_vector_null_reason: str | None = None


class SteeringResult(Record):
    """One cell's D2 record and D3 records as the artifact store holds them, with the key they sit under."""

    d2: D2Record
    d3: list[D3Record]
    key: str


class SteeringStage(TypedDict):
    """What the steering stage hands the results: the scorers' validity, every D2 and D3 record, and how it ran."""

    scorers: list[ScorerValidity]
    d2: list[D2Record]
    d3: list[D3Record]
    steering_config: dict
    subset: str
    timing: dict[str, float]
