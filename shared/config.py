"""RunConfig: every option of a benchmark run, validated once where it enters (CLI or HTTP)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from poolbench.defaults import DEFAULT_RUN_DIR, EMBEDDED, default_store_url

RESIDUAL_SITE = "residual"  # the block output: the run's main site, the one both steering backends add at


class RunConfig(BaseModel):
    """The options of `poolbench-driver run`; everything that determines a number is recorded in results.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = EMBEDDED
    model_args: dict[str, str] = Field(default_factory=dict)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    corpus: str = EMBEDDED
    corpus_size: Literal["tiny", "small", "full"] = "small"
    concepts: tuple[str, ...] | None = None
    layers: tuple[int, ...] | Literal["all"] | None = None  # None: default_layers(n) of the model
    strategies: tuple[str, ...] | None = None
    store: str | None = None
    out: str = DEFAULT_RUN_DIR
    batch_size: int = Field(32, ge=1)
    max_batch_tokens: int | None = Field(None, ge=1)
    # Concepts sharing forwards, up to this many tokens per pooling job; None: on a GPU 16 forwards at the batch
    # budget, on CPU one concept per job; 0: one concept per job everywhere (poolbench.driver.pool_groups).
    concept_group_tokens: int | None = Field(None, ge=0)
    overlap: bool | None = None  # text extras and probe tasks beside the forward; None: on CUDA only (probe_gate)
    max_length: int = Field(256, ge=8)
    limit: int | None = Field(None, ge=4)
    train_limit: int | None = Field(None, ge=4)  # at most N train passages per class (a learning curve's size)
    test_limit: int | None = Field(None, ge=4)  # at most N test passages per class (a learning curve's fixed test)
    seed: int = 0
    n_folds: int = Field(5, ge=2)
    n_bootstrap: int = Field(1000, ge=0)
    rope: float = Field(0.01, gt=0.0, lt=0.5)  # the answer's region of practical equivalence (AUROC)
    # The model that judges D2's fluency (poolbench.steerer.fluency): "auto" (the other embedded model), "self" (the
    # steered model), or any model reference --model takes
    reference_model: str = Field("auto", min_length=1)
    address: str | None = None
    num_workers: int | None = Field(None, ge=1)
    torch_threads: int | None = Field(None, ge=1)
    dump_activations: bool = False
    reliability: bool = True
    steering: bool = True
    full: bool = False
    allow_weak_scorer: bool = False
    backend: Literal["transformers", "vllm"] = "transformers"
    tensor_parallel_size: int = Field(1, ge=1)  # GPUs per vLLM engine (one steering actor each)
    vllm_eager: bool = False  # --backend vllm: run the engine eagerly, not compiled (docs/vllm-steering.md)
    flash: str | None = None
    store_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # pooled vectors in the store
    # D1's protocol: PoolBench's (pair-grouped CV, held-out test) or "pb", the reference leaderboard's (train-split
    # 5-fold OOF DiffMean AUROC, seed 42, no held-out test: poolbench.prober.pb_protocol)
    protocol: Literal["poolbench", "pb"] = "poolbench"
    # Cell axes beside layers (issue 44): activation sites (the block output "residual", the attention or MLP
    # sub-block's output) and context lengths (each test passage also read inside k x its length of neutral text,
    # probes trained at length 1). The residual site at length 1 is the run's main axis: its cells are the run's
    # cells, leaderboard and answer; the others are extra cells beside them (poolbench.driver.variants).
    sites: tuple[Literal["residual", "attn", "mlp"], ...] = (RESIDUAL_SITE,)
    context_lengths: tuple[int, ...] = (1,)

    @field_validator("concepts", "strategies")
    @classmethod
    def _non_empty(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and len(value) == 0:
            raise ValueError("must name at least one")
        return value

    @field_validator("sites")
    @classmethod
    def _sites(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if RESIDUAL_SITE not in value:
            raise ValueError("must include residual (the run's leaderboard, answer and steering read the block output)")
        if len(set(value)) != len(value):
            raise ValueError(f"{list(value)} repeats a site")
        return value

    @field_validator("context_lengths")
    @classmethod
    def _lengths(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if 1 not in value or any(k < 1 for k in value) or len(set(value)) != len(value):
            raise ValueError(f"{list(value)}: whole multiples >= 1 of a passage's length, 1 included, none repeated")
        return tuple(sorted(value))

    def resolved_store(self) -> str:
        return self.store or default_store_url()
