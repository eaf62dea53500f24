"""poolbench-driver: the thinnest shell over the pipeline; every error it shows is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from poolbench.cli.calibrate import calibrate
from poolbench.cli.capability import capability
from poolbench.cli.cebench import bias, cebench, sae_train
from poolbench.cli.command_order import RootGroup
from poolbench.cli.contenders import contenders, learning_curve
from poolbench.cli.export import export_vector
from poolbench.cli.findings import findings
from poolbench.cli.listing import list_app
from poolbench.cli.options import DEFAULT_RUN, out_folder
from poolbench.cli.reliability import flash_check, power
from poolbench.cli.report import report
from poolbench.cli.reproduce import reproduce
from poolbench.cli.run_display import RunDisplay, run_progress
from poolbench.cli.steerability import validate_steerability
from poolbench.cli.steering import serve_scorers, steer, train_scorers
from poolbench.cli.store import verify
from poolbench.cluster.commands import cluster_app
from poolbench.defaults import EMBEDDED
from poolbench.errors import PoolBenchError, without_colours

if TYPE_CHECKING:
    from poolbench.config import RunConfig
    from poolbench.results.answer import RunAnswer


app = typer.Typer(cls=RootGroup, add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="PoolBench: which pooling strategy captures a concept, at which layer.")
model_app = typer.Typer(no_args_is_help=True, help="Models: build the embedded default.")
corpus_app = typer.Typer(no_args_is_help=True, help="Corpora: write the embedded corpus to a folder.")
app.add_typer(model_app, name="model")
app.add_typer(corpus_app, name="corpus")
sae_app = typer.Typer(no_args_is_help=True, help="Sparse autoencoders for CE-Bench: train one offline.")
app.add_typer(sae_app, name="sae")
sae_app.command("train")(sae_train)
app.command("power")(power)
app.command("flash-check")(flash_check)
app.command("cebench")(cebench)
app.command("bias")(bias)
app.command("report")(report)
app.command("findings")(findings)
app.command("steer")(steer)
app.command("train-scorers")(train_scorers)
app.command("serve-scorers")(serve_scorers)
app.command("validate-steerability")(validate_steerability)
app.command("export-vector")(export_vector)
app.command("capability")(capability)
store_app = typer.Typer(no_args_is_help=True, help="Check the artifact store.")
app.add_typer(store_app, name="store")
app.add_typer(list_app, name="list")
store_app.command("verify")(verify)
app.command("calibrate")(calibrate)
app.command("reproduce")(reproduce)
app.command("learning-curve")(learning_curve)
app.command("contenders")(contenders)
app.add_typer(cluster_app, name="cluster")
# Wide enough for the leaderboard when output is piped (rich falls back to 80 columns there).
console = Console() if Console().is_terminal else Console(width=140)
err_console = Console(stderr=True)


# RunConfig fields whose option has another name: an error names the option the user typed.
_OPTION_OF_FIELD = {"n_folds": "folds"}


def _split(values: list[str] | None) -> tuple[str, ...] | None:
    """Accept both repeated flags and comma lists: --concepts a,b --concepts c."""
    if not values:
        return None
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


def _parse_model_args(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PoolBenchError(f"--model-args: '{item}' is not key=value")
        pairs[key.strip()] = value.strip()
    return pairs


@app.command()
def run(
    model: Annotated[list[str] | None, typer.Option(
        help="HF id or local path; 'embedded' is the built-in model, 'embedded-gemma' Gemma-3-270M; repeat "
             "(--model a --model b) or comma list for one run over several models and the cross-model table")]
    = None,
    model_args: Annotated[str | None, typer.Option(help="from_pretrained kwargs, k=v,k=v")] = None,
    corpus: Annotated[str, typer.Option(help="PoolBench-layout folder, or 'embedded'")] = EMBEDDED,
    corpus_size: Annotated[str, typer.Option(help="embedded corpus size: tiny, small, full")] = "small",
    concepts: Annotated[list[str] | None, typer.Option(help="concepts (comma list); default all")] = None,
    layers: Annotated[list[str] | None, typer.Option(
        help="layer indices (comma list) or 'all'; default: every layer of a model with <= 6, else 6 evenly spaced")]
    = None,
    strategies: Annotated[list[str] | None, typer.Option(help="strategy ids (comma list); default all")] = None,
    sites: Annotated[list[str] | None, typer.Option(
        help="activation sites (comma list): residual (block output), attn, mlp (sub-block outputs); default residual")]
    = None,
    context_lengths: Annotated[list[str] | None, typer.Option(
        help="also read each test passage inside k x its length of neutral text (comma list, 1 included, e.g. 1,4); "
             "probes train at length 1")] = None,
    strategy_module: Annotated[list[Path] | None, typer.Option(help="a .py file registering strategies")] = None,
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    out: Annotated[Path, typer.Option(help="run folder: results.json, leaderboard.json go here")] = DEFAULT_RUN,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:1")] = "auto",
    batch_size: Annotated[int, typer.Option(help="passages per forward pass")] = 32,
    max_batch_tokens: Annotated[int | None, typer.Option(
        help="padded tokens per forward (default: from free memory, at most 8192); results do not change")] = None,
    concept_group_tokens: Annotated[int | None, typer.Option(
        help="concepts share forwards up to this many tokens per pooling job (default: on a GPU 16 forwards at the "
             "batch budget, on CPU one concept per job; 0: one per job)")] = None,
    overlap: Annotated[bool | None, typer.Option(
        "--overlap/--no-overlap", help="prepare the next batch's text extras and run the D1 probe tasks while "
                                       "the forward runs (default: on CUDA only; on CPU the probes then share its "
                                       "cores)")] = None,
    max_length: Annotated[int, typer.Option(help="truncate passages to this many tokens")] = 256,
    limit: Annotated[int | None, typer.Option(help="at most N passages per split and class")] = None,
    seed: Annotated[int, typer.Option(help="seed for folds, probes and bootstrap")] = 0,
    folds: Annotated[int, typer.Option(help="cross-validation folds")] = 5,
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples for CIs")] = 1000,
    address: Annotated[str | None, typer.Option(help="Ray address to join ('auto'); default: local Ray")] = None,
    num_workers: Annotated[int | None, typer.Option(
        help="extractor workers (default: one per GPU, else one per node with 2+ CPUs)")] = None,
    torch_threads: Annotated[int | None, typer.Option(help="torch threads per CPU worker")] = None,
    dump_activations: Annotated[bool, typer.Option(help="also store token activations (float16 Arrow)")] = False,
    reliability: Annotated[bool, typer.Option(help="seed spread, selectivity and MDL for every cell")] = True,
    steering: Annotated[bool, typer.Option(help="D2/D3 after D1 (default subset; --full for every cell)")] = True,
    full: Annotated[bool, typer.Option(help="steer every concept x strategy at its D1 layer, 50 prompts")] = False,
    allow_weak_scorer: Annotated[bool, typer.Option(help="keep scorers with held-out AUROC < 0.7")] = False,
    backend: Annotated[str, typer.Option(help="steering backend: transformers or vllm (GPU or CPU)")]
    = "transformers",
    tensor_parallel_size: Annotated[int, typer.Option(
        help="--backend vllm: GPUs per engine, for a model that does not fit one card (one steering actor each)")]
    = 1,
    vllm_eager: Annotated[bool, typer.Option(
        help="--backend vllm: run the engine eagerly (no torch.compile, no CUDA graphs); compiled by default")] = False,
    flash: Annotated[str | None, typer.Option(help="train probes on a stratified, pair-preserving fraction, e.g. 1/32")]
    = None,
    log_samples: Annotated[bool, typer.Option(
        help="also write samples_<date>.jsonl: every held-out passage's probe score at each strategy's chosen cell")]
    = False,
    store_dtype: Annotated[str, typer.Option(
        help="pooled vectors in the store: float32, float16 or bfloat16 (half the size; probed as float32)")]
    = "float32",
    reference_model: Annotated[str, typer.Option(
        help="the model that judges D2's fluency guard: auto (the other embedded model), self (the steered model) "
             "or a model reference as --model takes")] = "auto",
    rope: Annotated[float, typer.Option(
        help="region of practical equivalence (AUROC) of the answer's Bayesian signed-rank test")] = 0.01,
    protocol: Annotated[str, typer.Option(
        help="D1 protocol: poolbench (pair-grouped CV + held-out test) or pb, the official leaderboard's "
             "(train split, 5-fold OOF DiffMean AUROC, seed 42; CV-only)")] = "poolbench",
    wandb_args: Annotated[str | None, typer.Option(
        help="log the run to W&B: wandb.init's k=v,k=v, e.g. project=p,mode=offline (extra [wandb])")] = None,
    mlflow_uri: Annotated[str | None, typer.Option(help="log the run to this MLflow tracking URI (extra [mlflow])")]
    = None,
    capability_task: Annotated[str | None, typer.Option(
        help="after steering, score this lm-eval task (a YAML in --capability-task-dir) at each steered cell's "
             "alpha* and at 0: what steering costs")] = None,
    capability_task_dir: Annotated[Path, typer.Option(help="folder of task YAMLs and their local data")]
    = Path("tasks"),
) -> None:
    """Extract, pool and probe every (concept, layer, strategy) cell; write results.json and leaderboard.json
    (and results_<UTC date-time>.json, leaderboard_<...>.json beside them, kept per run)."""
    from pydantic import ValidationError

    from poolbench.api import evaluate_config
    from poolbench.cli.board import summary_line
    from poolbench.config import RunConfig
    from poolbench.results.trackers import log_trackers, tracker_options

    trackers = tracker_options(wandb_args, mlflow_uri)
    if capability_task is not None:
        from poolbench.results.capability_run import check_capability_task

        check_capability_task(capability_task, capability_task_dir, steering=steering)
    models = _split(model) or (EMBEDDED,)
    try:
        cfg = RunConfig(
            model=models[0], model_args=_parse_model_args(model_args), dtype=dtype, device=device, corpus=corpus,
            corpus_size=corpus_size, concepts=_split(concepts),
            layers=_layers(layers),
            strategies=_split(strategies), store=store, out=str(out), batch_size=batch_size,
            max_batch_tokens=max_batch_tokens, concept_group_tokens=concept_group_tokens, overlap=overlap,
            max_length=max_length, limit=limit, seed=seed, n_folds=folds, n_bootstrap=n_bootstrap,
            address=address, num_workers=num_workers, torch_threads=torch_threads,
            dump_activations=dump_activations, reliability=reliability, steering=steering, full=full,
            allow_weak_scorer=allow_weak_scorer, backend=backend, flash=flash, store_dtype=store_dtype,
            tensor_parallel_size=tensor_parallel_size, vllm_eager=vllm_eager, rope=rope, protocol=protocol,
            reference_model=reference_model,
            **({"sites": _split(sites)} if sites else {}),
            **({"context_lengths": _lengths(context_lengths)} if context_lengths else {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        option = _OPTION_OF_FIELD.get(field, field.replace("_", "-"))
        raise PoolBenchError(f"--{option}: {first['msg']}") from None
    except ValueError as exc:
        raise PoolBenchError(f"--layers: {exc}") from None

    if len(models) > 1:
        for folder in _run_models(cfg, models, log_samples, tuple(str(p) for p in strategy_module or ())):
            _capability_stage(folder, capability_task, capability_task_dir, seed=seed, n_bootstrap=n_bootstrap)
            _print_lines(log_trackers(folder, trackers, store=store))
        return
    with run_progress(console) as progress:
        results = evaluate_config(cfg, on_event=RunDisplay(progress).show, log_samples=log_samples,
                                  strategy_modules=tuple(str(p) for p in strategy_module or ()))
    from poolbench.results.answer import read_answer

    paths = results.paths
    _capability_stage(paths["results"].parent, capability_task, capability_task_dir, seed=seed,
                      n_bootstrap=n_bootstrap, stamped=(paths["results_stamped"], paths["answer_stamped"]))
    answer = read_answer(paths["answer"])
    _print_leaderboard(results.leaderboard, answer)
    computed = ", ".join(f"{k} {v}" for k, v in (results.document.get("computed") or {}).items())
    samples = f", {paths['samples'].name}" if "samples" in paths else ""
    console.print(f"computed: {computed}; wrote {paths['results_stamped'].name}, {paths['leaderboard_stamped'].name}"
                  f"{samples} (latest: results.json, leaderboard.json)", soft_wrap=True, highlight=False)
    console.print(summary_line(results.leaderboard, total_s=float((results.document.get("timing") or {}).get(
        "total_s", 0.0)), results_path=paths["results"], answer=answer), soft_wrap=True, highlight=False)
    _print_lines(log_trackers(paths["results"].parent, trackers, store=store))
    _print_answer(answer)


def _print_lines(lines: list[str]) -> None:
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def _capability_stage(folder: Path, task: str | None, task_dir: Path, *, seed: int, n_bootstrap: int,
                      stamped: tuple[Path, ...] = ()) -> None:
    """`--capability-task` after a finished run folder; nothing (and no import) when the run did not ask for it."""
    if task is None:
        return
    from poolbench.http.capability_service import run_capability_stage

    _print_lines(run_capability_stage(folder, task, task_dir, seed=seed, n_bootstrap=n_bootstrap, stamped=stamped))


def _run_models(cfg: RunConfig, models: tuple[str, ...], log_samples: bool, strategy_modules: tuple[str, ...]
                ) -> list[Path]:
    """One run over several models: each model's summary as it finishes, then the cross-model table and answer."""
    from poolbench.api import evaluate_models
    from poolbench.cli.board import summary_line
    from poolbench.cli.cross_model_board import cross_model_answer, cross_model_board
    from poolbench.results.answer import read_answer

    with run_progress(console) as progress:
        results = evaluate_models(cfg, models, on_event=RunDisplay(progress).show, log_samples=log_samples,
                                  strategy_modules=strategy_modules)
    for name, result in results.per_model.items():
        console.print(f"{name}: " + summary_line(result.leaderboard, total_s=float(
            (result.document.get("timing") or {}).get("total_s", 0.0)), results_path=result.paths["results"],
            answer=read_answer(result.paths["answer"])), soft_wrap=True, highlight=False)
    table = results.document["cross_model"]
    console.print(cross_model_board(table))
    console.print(f"wrote {results.paths['results']}, {results.paths['leaderboard']}, "
                  f"{results.paths['cross_model_csv'].name} and one folder per model", soft_wrap=True, highlight=False)
    console.print(cross_model_answer(table), soft_wrap=True, highlight=False, markup=False)
    return [result.paths["results"].parent for result in results.per_model.values()]


def _print_answer(answer: RunAnswer) -> None:
    """The run's answer, last: what a person repeats, rendered from the answer.json the run wrote."""
    from poolbench.results.answer import answer_text

    console.print(answer_text(answer), soft_wrap=True, highlight=False, markup=False)


def _print_leaderboard(leaderboard: dict, answer: RunAnswer | None = None) -> None:
    from poolbench.cli.board import leaderboard_table

    console.print(leaderboard_table(leaderboard, answer))


@app.command()
def leaderboard(
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
) -> None:
    """Print the leaderboard of a finished run."""
    path = run_dir / "leaderboard.json"
    if not path.is_file():
        raise PoolBenchError(f"no leaderboard.json in {run_dir}")
    board = json.loads(path.read_text())
    if board.get("kind") == "cross_model":
        from poolbench.cli.cross_model_board import cross_model_answer, cross_model_board

        console.print(cross_model_board(board["cross_model"]))
        console.print(cross_model_answer(board["cross_model"]), soft_wrap=True, highlight=False, markup=False)
        return
    from poolbench.results.answer import ANSWER_FILE, read_answer

    _print_leaderboard(board, read_answer(run_dir / ANSWER_FILE) if (run_dir / ANSWER_FILE).is_file() else None)


@app.command("validate-corpus")
def validate_corpus_cmd(
    directory: Annotated[Path, typer.Argument(help="a PoolBench-layout corpus folder")],
    tokenizer: Annotated[str | None, typer.Option(help="HF tokenizer id or path for token checks")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="the token window passages must fit")] = None,
) -> None:
    """Check schema, labels, splits, duplicates, pairs, domains and balance; exit 1 on hard errors."""
    from poolbench.corpus.validation import profile_corpus, render_findings, render_profile, validate_corpus

    tok = None
    if tokenizer:
        from poolbench.extractor.loading import load_tokenizer

        tok = load_tokenizer(tokenizer)
    findings = validate_corpus(directory, tokenizer=tok, max_tokens=max_tokens)
    if console.is_terminal:
        console.print(render_findings(findings))
    else:  # piped or captured: one grep-able line per finding, never wrapped
        for finding in sorted(findings, key=lambda f: (f.severity != "error", f.file, f.line or 0)):
            console.print(str(finding), soft_wrap=True, markup=False, highlight=False)
    console.print(render_profile(profile_corpus(directory)))
    errors = [f for f in findings if f.severity == "error"]
    console.print(f"{len(errors)} error(s), {len(findings) - len(errors)} warning(s) in {directory}", soft_wrap=True)
    if errors:
        raise typer.Exit(1)


@corpus_app.command("build")
def corpus_build(
    out: Annotated[Path, typer.Option(help="corpus folder to write the PoolBench layout into")],
    size: Annotated[str, typer.Option(help="tiny, small or full")] = "small",
    seed: Annotated[int, typer.Option(help="generator seed")] = 0,
) -> None:
    """Write the embedded 17-concept corpus in the PoolBench layout."""
    from poolbench.corpus.embedded import CONCEPTS
    from poolbench.corpus.source import write_embedded_corpus

    if size not in ("tiny", "small", "full"):
        raise PoolBenchError(f"--size '{size}' is not one of tiny, small, full")
    n_passages = write_embedded_corpus(out, size, seed)
    console.print(f"wrote {n_passages} passages of {len(CONCEPTS)} concepts to {out}")


@model_app.command("build")
def model_build(
    model: Annotated[str, typer.Argument(help="'embedded' (convert SmolLM2's GGUF), 'tiny' (train) or a .gguf")]
    = EMBEDDED,
) -> None:
    """Prepare a model once into the cache: convert a GGUF (the embedded default) or train the tiny model."""
    from poolbench.extractor.loading import local_model_dir

    path = local_model_dir(model)
    build = path / "poolbench_build.json" if path is not None else None
    if build is not None and build.is_file():
        report = json.loads(build.read_text())
        console.print(f"model '{model}' at {path}: held-out perplexity {report['heldout_perplexity']:.2f}, "
                      f"{report.get('train_seconds', 0):.0f}s to train")
    else:
        console.print(f"model '{model}' at {path}")


@app.command("export-submission")
def export_submission(
    strategy: Annotated[str, typer.Option(help="strategy id, e.g. A1_mean")],
    model_key: Annotated[str, typer.Option(help="llama3_8b, gemma2_9b, mistral_7b, qwen25_7b, ...")],
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
    source: Annotated[str, typer.Option(help="community, or published (implements a paper)")] = "community",
    out: Annotated[Path | None, typer.Option(help="folder for submission_<strategy>.json; default the run folder")]
    = None,
    allow_other_protocol: Annotated[bool, typer.Option(
        help="write a D1 not computed under --protocol pb, labelled so in its description and a sidecar file")]
    = False,
) -> None:
    """Write one strategy's results in the PoolBench community-submission format."""
    from poolbench.results.document import write_json_atomic
    from poolbench.results.submission import (
        LEADERBOARD_PROTOCOL,
        build_submission,
        check_protocol,
        protocol_sidecar,
    )

    lb_path, res_path = run_dir / "leaderboard.json", run_dir / "results.json"
    for path in (lb_path, res_path):
        if not path.is_file():
            raise PoolBenchError(f"no {path.name} in {run_dir}")
    info = {s["id"]: s for s in json.loads(res_path.read_text())["strategies"]}
    if strategy not in info:
        raise PoolBenchError(f"strategy '{strategy}' was not run in {run_dir} (ran: {', '.join(info)})")
    leaderboard = json.loads(lb_path.read_text())
    protocol = check_protocol(leaderboard, str(lb_path), allow_other_protocol)
    submission = build_submission(leaderboard, strategy, model_key, source, info[strategy])
    folder = out_folder(out) if out is not None else run_dir
    target = folder / f"submission_{strategy}.json"
    write_json_atomic(target, submission.model_dump(mode="json"))
    console.print(f"wrote {target}")
    if protocol != LEADERBOARD_PROTOCOL:
        sidecar = folder / f"submission_{strategy}.protocol.json"
        write_json_atomic(sidecar, protocol_sidecar(leaderboard, strategy, model_key))
        console.print(f"wrote {sidecar}: D1 is protocol '{protocol}', not the leaderboard's '{LEADERBOARD_PROTOCOL}'")


def _lengths(values: list[str]) -> tuple[int, ...]:
    items = _split(values) or ()
    try:
        return tuple(int(v) for v in items)
    except ValueError:
        raise PoolBenchError(f"--context-lengths: {','.join(items)} is not a comma list of whole numbers") from None


def _layers(values: list[str] | None) -> tuple[int, ...] | Literal["all"] | None:
    names = _split(values)
    if names == ("all",):
        return "all"
    return tuple(int(v) for v in names) if names else None


def main() -> None:
    # Our own progress display is the one a person reads: no per-model loading bars from HF or workers.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        app()
    except PoolBenchError as exc:
        # An error raised inside a Ray worker arrives wrapped (RayTaskError): show the worker's own line.
        cause = getattr(exc, "cause", None)
        fail(str(cause if isinstance(cause, PoolBenchError) else exc))
    except Exception as exc:
        if not type(exc).__module__.startswith("ray."):
            raise
        from poolbench.driver.work_queue import worker_death_cause

        fail(f"a Ray worker failed: {worker_death_cause(getattr(exc, 'cause', None) or exc)}")


def fail(message: str) -> None:
    """One line on stderr, colour codes from remote tracebacks removed, and exit 1."""
    text = without_colours(message).strip()
    err_console.print(f"error: {text.splitlines()[0] if text else 'failed'}", highlight=False, markup=False,
                      soft_wrap=True)
    sys.exit(1)
