"""RunConfig: every option of a benchmark run, written once, in the group of its concern: its type, default and
validation (pydantic), its `run` option name and help (an `Option` in the field's metadata). The CLI's `run`
(poolbench.cli.run_options), `poolbench.evaluate` and the HTTP service all build it from here; results.json records
it. A new option is one field in its group (CONVENTIONS.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from poolbench.defaults import DEFAULT_PROTOCOL, DEFAULT_RUN_DIR, EMBEDDED, check_protocol, default_store_url
from poolbench.errors import PoolBenchError

GroupT = TypeVar("GroupT", bound=BaseModel)
RESIDUAL_SITE = "residual"  # the block output: the run's main site, the one both steering backends add at


def split_list(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Accept both repeated flags and comma lists: --concepts a,b --concepts c."""
    if not values:
        return None
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


def parse_model_args(text: str | None) -> dict[str, str]:
    """`k=v,k=v` -> from_pretrained keyword arguments."""
    if not text:
        return {}
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PoolBenchError(f"--model-args: '{item}' is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


def parse_layers(values: list[str]) -> tuple[int, ...] | Literal["all"] | None:
    names = split_list(values)
    if names == ("all",):
        return "all"
    try:
        return tuple(int(v) for v in names) if names else None
    except ValueError as exc:
        raise PoolBenchError(f"--layers: {exc}") from None


def parse_lengths(values: list[str]) -> tuple[int, ...]:
    items = split_list(values) or ()
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise PoolBenchError(f"--context-lengths: {','.join(items)} is not a comma list of whole numbers") from None


def parse_paths(values: list[Path]) -> tuple[str, ...]:
    return tuple(str(p) for p in values)


@dataclass(frozen=True)
class Option:
    """How a RunConfig field is written on `run`'s command line; a field without one is not a `run` option."""

    help: str
    name: str | None = None  # the option's name where it is not the field's (n_folds -> --folds)
    many: bool = False  # repeatable and comma lists: the command line gives list[str], None when not given
    parse: Callable[[Any], Any] | None = None  # the command-line value -> the field's value (given values only)
    cli_type: Any = None  # what the command line parses, where it is not the field's own type
    flag: str | None = None  # a switch pair where Typer's own is not wanted ("--overlap/--no-overlap")

    def option_name(self, field: str) -> str:
        return f"--{self.name or field.replace('_', '-')}"


def opt(help: str, **how: Any) -> Option:
    """A field's `run` option: `Annotated[type, opt("help", ...)] = default` (Field(...) beside it validates)."""
    return Option(help, **how)


class ModelOptions(BaseModel):
    """Which model is read, and how it loads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Annotated[str, opt(
        "HF id or local path; 'embedded' is the built-in model, 'embedded-gemma' Gemma-3-270M; repeat "
        "(--model a --model b) or comma list for one run over several models and the cross-model table",
        many=True)] = EMBEDDED
    model_args: Annotated[dict[str, str], opt("from_pretrained kwargs, k=v,k=v", cli_type=str | None,
                                              parse=parse_model_args)] = Field(default_factory=dict)
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], opt(
        "auto, float32, bfloat16, float16")] = "auto"
    device: Annotated[str, opt("auto, cpu, cuda, cuda:1")] = "auto"


class CorpusOptions(BaseModel):
    """Which passages: the corpus, its concepts and how many of each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: Annotated[str, opt("PoolBench-layout folder, or 'embedded'")] = EMBEDDED
    corpus_size: Annotated[Literal["tiny", "small", "full"], opt("embedded corpus size: tiny, small, full")] = "small"
    concepts: Annotated[tuple[str, ...] | None, opt("concepts (comma list); default all", many=True,
                                                    parse=split_list)] = None
    limit: Annotated[int | None, Field(ge=4), opt("at most N passages per split and class")] = None
    train_limit: int | None = Field(None, ge=4)  # at most N train passages per class (a learning curve's size)
    test_limit: int | None = Field(None, ge=4)  # at most N test passages per class (a learning curve's fixed test)


class ExtractionOptions(BaseModel):
    """Which cells are pooled (layers, strategies, sites, context lengths) and how the forwards are batched."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: Annotated[tuple[int, ...] | Literal["all"] | None, opt(
        "layer indices (comma list) or 'all'; default: every layer of a model with <= 6, else 6 evenly spaced",
        many=True, parse=parse_layers)] = None  # None: default_layers(n) of the model
    strategies: Annotated[tuple[str, ...] | None, opt("strategy ids (comma list); default all", many=True,
                                                      parse=split_list)] = None
    # Cell axes beside layers (issue 44): activation sites (the block output "residual", the attention or MLP
    # sub-block's output) and context lengths (each test passage also read inside k x its length of neutral text,
    # probes trained at length 1). The residual site at length 1 is the run's main axis: its cells are the run's
    # cells, leaderboard and answer; the others are extra cells beside them (poolbench.driver.variants).
    sites: Annotated[tuple[Literal["residual", "attn", "mlp"], ...], opt(
        "activation sites (comma list): residual (block output), attn, mlp (sub-block outputs); default residual",
        many=True, parse=split_list)] = (RESIDUAL_SITE,)
    context_lengths: Annotated[tuple[int, ...], opt(
        "also read each test passage inside k x its length of neutral text (comma list, 1 included, e.g. 1,4); "
        "probes train at length 1", many=True, parse=parse_lengths)] = (1,)
    strategy_modules: Annotated[tuple[str, ...], Field(exclude=True), opt(
        "a .py file registering strategies", name="strategy-module", many=True, cli_type=list[Path] | None,
        parse=parse_paths)] = ()
    batch_size: Annotated[int, Field(ge=1), opt(
        "passages per forward pass, at most (the token budget may cut fewer)")] = 32
    max_batch_tokens: Annotated[int | None, Field(ge=1), opt(
        "padded tokens per forward (default: on a CPU 1024, on a GPU from free memory, at most 8192); results "
        "equal to round-off (docs/reproducibility.md)")] = None
    # Concepts sharing forwards, up to this many tokens per pooling job; None: on a GPU 16 forwards at the batch
    # budget, on CPU one concept per job; 0: one concept per job everywhere (poolbench.driver.pool_groups).
    concept_group_tokens: Annotated[int | None, Field(ge=0), opt(
        "concepts share forwards up to this many tokens per pooling job (default: on a GPU 16 forwards at the "
        "batch budget, on CPU one concept per job; 0: one per job)")] = None
    # Text extras and probe tasks beside the forward; None: on CUDA only (poolbench.driver.probe_gate)
    overlap: Annotated[bool | None, opt(
        "prepare the next batch's text extras and run the D1 probe tasks while the forward runs (default: on CUDA "
        "only; on CPU the probes then share its cores)", flag="--overlap/--no-overlap")] = None
    max_length: Annotated[int, Field(ge=8), opt("truncate passages to this many tokens")] = 256
    store_dtype: Annotated[Literal["float32", "float16", "bfloat16"], opt(
        "pooled vectors in the store: float32, float16 or bfloat16 (half the size; probed as float32)")] = "float32"
    dump_activations: Annotated[bool, opt("also store token activations (float16 Arrow)")] = False

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


class ProbingOptions(BaseModel):
    """D1: how every cell is probed, and the answer's equivalence region; a probe task receives this group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: Annotated[int, opt("seed for folds, probes and bootstrap")] = 0
    n_folds: Annotated[int, Field(ge=2), opt("cross-validation folds", name="folds")] = 5
    n_bootstrap: Annotated[int, Field(ge=0), opt("bootstrap resamples for CIs")] = 1000
    reliability: Annotated[bool, opt("seed spread, selectivity and MDL for every cell")] = True
    flash: Annotated[str | None, opt(
        "train probes on a stratified, pair-preserving fraction, e.g. 1/32")] = None
    # PoolBench's protocol (pair-grouped CV, held-out test) or "pb", the reference leaderboard's (train-split
    # 5-fold OOF DiffMean AUROC, seed 42, no held-out test: poolbench.prober.pb_protocol)
    protocol: Annotated[str, opt(
        "D1 protocol: poolbench (pair-grouped CV + held-out test) or pb, the official leaderboard's "
        "(train split, 5-fold OOF DiffMean AUROC, seed 42; CV-only)")] = DEFAULT_PROTOCOL
    rope: Annotated[float, Field(gt=0.0, lt=0.5), opt(
        "region of practical equivalence (AUROC) of the answer's Bayesian signed-rank test")] = 0.01

    @field_validator("protocol")
    @classmethod
    def _protocol(cls, value: str) -> str:
        return check_protocol(value)


class SteeringOptions(BaseModel):
    """D2/D3 after D1: which cells are steered, on which backend, judged by which reference, then capability."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steering: Annotated[bool, opt("D2/D3 after D1 (default subset; --full for every cell)")] = True
    full: Annotated[bool, opt("steer every concept x strategy at its D1 layer, 50 prompts")] = False
    allow_weak_scorer: Annotated[bool, opt("keep scorers with held-out AUROC < 0.7")] = False
    backend: Annotated[Literal["transformers", "vllm"], opt(
        "steering backend: transformers or vllm (GPU or CPU)")] = "transformers"
    tensor_parallel_size: Annotated[int, Field(ge=1), opt(
        "--backend vllm: GPUs per engine, for a model that does not fit one card (one steering actor each)")] = 1
    vllm_eager: Annotated[bool, opt(
        "--backend vllm: run the engine eagerly (no torch.compile, no CUDA graphs); compiled by default "
        "(docs/vllm-steering.md)")] = False
    # The model that judges D2's fluency (poolbench.steerer.fluency): "auto" (the other embedded model), "self" (the
    # steered model), or any model reference --model takes
    reference_model: Annotated[str, Field(min_length=1), opt(
        "the model that judges D2's fluency guard: auto (the other embedded model), self (the steered model) "
        "or a model reference as --model takes")] = "auto"
    capability_task: Annotated[str | None, Field(exclude=True), opt(
        "after steering, score this lm-eval task (a YAML in --capability-task-dir) at each steered cell's "
        "alpha* and at 0: what steering costs")] = None
    capability_task_dir: Annotated[Path, Field(exclude=True), opt(
        "folder of task YAMLs and their local data")] = Path("tasks")


class PlacementOptions(BaseModel):
    """Where the run's work happens and where its artifacts and files go."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: Annotated[str | None, opt("artifact store: a folder or s3://bucket/prefix")] = None
    out: Annotated[str, opt("run folder: results.json, leaderboard.json go here", cli_type=Path,
                            parse=str)] = DEFAULT_RUN_DIR
    address: Annotated[str | None, opt("Ray address to join ('auto'); default: local Ray")] = None
    num_workers: Annotated[int | None, Field(ge=1), opt(
        "extractor workers (default: one per GPU, else one per node with 2+ CPUs)")] = None
    torch_threads: Annotated[int | None, Field(ge=1), opt("torch threads per CPU worker")] = None
    # A D1 run whose vectors outgrow the store's disk (an 8B model's full corpus: ~10 GB a concept at float32):
    # pooler.pooled_drop, driver.room_gate. Changes no number; what later stages would read is gone.
    drop_pooled: Annotated[bool, opt(
        "delete each concept's pooled vectors (shards, S3's head tables, S2's gradient sums) once its D1 records "
        "and per-passage scores are stored, pooling only as far ahead as the store's disk has room (needs "
        "--no-steering; no steerability section)", flag="--drop-pooled/--keep-pooled")] = False

    def resolved_store(self) -> str:
        return self.store or default_store_url()


class TrackingOptions(BaseModel):
    """What else a run writes and where it is logged; none of it changes a number, so results.json leaves it out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_samples: Annotated[bool, Field(exclude=True), opt(
        "also write samples_<date>.jsonl: every held-out passage's probe score at each strategy's chosen cell")
    ] = False
    wandb_args: Annotated[str | None, Field(exclude=True), opt(
        "log the run to W&B: wandb.init's k=v,k=v, e.g. project=p,mode=offline (extra [wandb])")] = None
    mlflow_uri: Annotated[str | None, Field(exclude=True), opt(
        "log the run to this MLflow tracking URI (extra [mlflow])")] = None


GROUPS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("Model", ModelOptions), ("Corpus", CorpusOptions), ("Extraction and pooling", ExtractionOptions),
    ("Probing (D1)", ProbingOptions), ("Steering (D2, D3, capability)", SteeringOptions),
    ("Store and cluster", PlacementOptions), ("Outputs and tracking", TrackingOptions))
"""`run --help`'s panels, in order: each group's title and the model its fields are written in."""


class RunConfig(TrackingOptions, PlacementOptions, SteeringOptions, ProbingOptions, ExtractionOptions, CorpusOptions,
                ModelOptions):
    """The options of `poolbench-driver run`, flat (cfg.seed), each written once in its group; `cfg.probing` and
    the like hand a stage its group. Everything that determines a number is recorded in results.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("concepts", "strategies")
    @classmethod
    def _non_empty(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and len(value) == 0:
            raise ValueError("must name at least one")
        return value

    def group(self, model: type[GroupT]) -> GroupT:
        """This config's fields of one group, as that group's model."""
        return model.model_validate({name: getattr(self, name) for name in model.model_fields})

    @property
    def probing(self) -> ProbingOptions:
        return self.group(ProbingOptions)


def resolve_overlap(overlap: bool | None, on_gpu: bool) -> bool:
    """--overlap's one rule: host work beside the forward where the forward leaves the CPU idle (a GPU) unless
    --no-overlap; on CPU the forward already uses every core, so only with --overlap."""
    return on_gpu if overlap is None else overlap


def field_group(name: str) -> str:
    """The help panel (group title) a RunConfig field is written in."""
    return next(title for title, model in GROUPS if name in model.model_fields)


def run_options() -> dict[str, Option]:
    """Every RunConfig field that is a `run` option, in panel order, with its Option."""
    out = {}
    for _, model in GROUPS:
        for name, info in model.model_fields.items():
            found = [m for m in info.metadata if isinstance(m, Option)]
            if found:
                out[name] = found[0]
    return out
