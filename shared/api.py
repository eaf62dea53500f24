"""The Python API for notebooks: `evaluate` (what `poolbench-driver run` does), `pool` (vectors for a few texts),
`load_results` (a finished run as typed records). The CLI's `run` calls `evaluate_config` too."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from poolbench.config import RunConfig
from poolbench.defaults import EMBEDDED
from poolbench.errors import PoolBenchError, StageFailed
from poolbench.records.base import RecordError
from poolbench.records.d1 import D1CellRecord, cv_best_row
from poolbench.records.events import EventSink
from poolbench.records.steering import D2Record, D3Record

if TYPE_CHECKING:
    from poolbench.driver.extractor_fleet import ExtractorFleet


@dataclass(frozen=True)
class Results:
    """A run's results.json and leaderboard.json, with D1, D2 and D3 as typed records; `paths` names the files
    (results, leaderboard, their timestamped copies, samples when logged)."""

    document: dict
    leaderboard: dict
    cells: list[D1CellRecord]
    d2: list[D2Record]
    d3: list[D3Record]
    paths: dict[str, Path] = field(default_factory=dict)
    messages: tuple[str, ...] = ()  # what the stages after the run said (capability, trackers), one line each

    @property
    def best(self) -> dict:
        """The row of the best strategy, chosen on training CV (the highest mean CV AUROC; ties to the first
        name), never on the held-out test: strategy, best_layer, mean_d1, mean_cv_auroc, per_concept."""
        return cv_best_row(self.leaderboard["strategies"])

    def mean_d1(self) -> dict[str, float]:
        """Each strategy's mean held-out D1 at its CV-chosen layer, in leaderboard order."""
        return {r["strategy"]: r["mean_d1"] for r in sorted(self.leaderboard["strategies"], key=lambda r: r["rank"])}


def results_of(document: dict, leaderboard: dict, paths: dict[str, Path] | None = None) -> Results:
    """The typed view of a results document; a malformed record stops in one line naming it."""
    try:
        return Results(document, leaderboard, [D1CellRecord.from_dict(c) for c in document.get("cells") or []],
                       [D2Record.from_dict(r) for r in document.get("d2") or []],
                       [D3Record.from_dict(r) for r in document.get("d3") or []], dict(paths or {}))
    except RecordError as exc:
        raise PoolBenchError(f"{(paths or {}).get('results', 'results')}: {exc}") from None


def load_results(path: str | Path) -> Results:
    """A run's --out folder (its latest results.json) or one results*.json file, with the leaderboard written
    beside it (rebuilt from the cells when there is none)."""
    from poolbench.results.answer.leaderboard import build_leaderboard

    path = Path(path)
    results_path = path / "results.json" if path.is_dir() else path
    if not results_path.is_file():
        raise PoolBenchError(f"no results.json in {path}" if path.is_dir() else f"{path} does not exist")
    try:
        document = json.loads(results_path.read_text())
    except ValueError as exc:
        raise PoolBenchError(f"{results_path} is not valid JSON ({exc})") from None
    board_path = results_path.with_name(results_path.name.replace("results", "leaderboard", 1))
    paths = {"results": results_path}
    if board_path.is_file():
        paths["leaderboard"] = board_path
        leaderboard = json.loads(board_path.read_text())
    else:
        leaderboard = {}
    results = results_of(document, leaderboard, paths)
    if not leaderboard:
        results = Results(document, build_leaderboard(results.cells), results.cells, results.d2, results.d3, paths)
    return results


def check_run_extras(cfg: RunConfig) -> None:
    """What runs after the benchmark (trackers, --capability-task) is checked before it, in one line each."""
    from poolbench.results.exports.trackers import tracker_options

    tracker_options(cfg.wandb_args, cfg.mlflow_uri)
    if cfg.capability_task is not None:
        from poolbench.capability.records import check_capability_task

        check_capability_task(cfg.capability_task, Path(cfg.capability_task_dir), steering=cfg.steering)


def evaluate_config(cfg: RunConfig, *, on_event: EventSink | None = None,
                    fleet: ExtractorFleet | None = None) -> Results:
    """Run the benchmark as `cfg` says, write results (timestamped and latest) into cfg.out, then the stages after
    it (samples, capability, trackers: cfg's tracking and steering groups), and return them; `fleet` lends
    extractor workers kept from an earlier model of the same run."""
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.results.documents.document import write_run_outputs

    outcome = run_benchmark(cfg, on_event, strategy_modules=cfg.strategy_modules, fleet=fleet)
    paths = write_run_outputs(outcome, Path(cfg.out))
    document = json.loads(paths["results"].read_text())
    leaderboard = json.loads(paths["leaderboard"].read_text())
    if document.get("errors"):
        first = document["errors"][0]
        raise StageFailed(f"{first['stage']} failed: {first['message']} (the D1 results are in {paths['results']})")
    if cfg.log_samples:
        from poolbench.results.answer.passage_table import read_run_scores
        from poolbench.results.exports.samples import write_generations, write_samples
        from poolbench.store.url import open_store

        stamp = paths["results_stamped"].stem.removeprefix("results_")
        store = open_store(cfg.resolved_store())
        scores = read_run_scores(Path(cfg.out))
        if scores is None:
            raise PoolBenchError(f"--log-samples: no per-passage score table in {cfg.out}")
        paths["samples"] = Path(cfg.out) / f"samples_{stamp}.jsonl"
        write_samples(leaderboard, scores, paths["samples"])
        if document.get("d2"):
            paths["generations"] = Path(cfg.out) / f"generations_{stamp}.jsonl"
            write_generations(document, store, paths["generations"])
    messages = _after_the_run(cfg, paths)
    document = json.loads(paths["results"].read_text())  # the capability stage adds its records
    return replace(results_of(document, leaderboard, paths), messages=tuple(messages))


def _after_the_run(cfg: RunConfig, paths: dict[str, Path]) -> list[str]:
    """--capability-task on the finished run folder, then the trackers; the lines each says."""
    from poolbench.results.exports.trackers import log_trackers, tracker_options

    lines = []
    if cfg.capability_task is not None:
        from poolbench.capability.stage import run_capability_stage

        lines += run_capability_stage(Path(cfg.out), cfg.capability_task, Path(cfg.capability_task_dir),
                                      n_bootstrap=cfg.n_bootstrap, seed=cfg.seed,
                                      stamped=(paths["results_stamped"], paths["answer_stamped"]))
    return lines + log_trackers(Path(cfg.out), tracker_options(cfg.wandb_args, cfg.mlflow_uri), store=cfg.store)


@dataclass(frozen=True)
class ModelsResults:
    """A run over several models: each model's Results (its own folder, as a single-model run writes it) and the
    run folder's cross-model results.json / leaderboard.json."""

    per_model: dict[str, Results]
    document: dict
    leaderboard: dict
    paths: dict[str, Path] = field(default_factory=dict)


def evaluate_models(cfg: RunConfig, models: Sequence[str], *, on_event: EventSink | None = None) -> ModelsResults:
    """`cfg` over each model in turn, into <out>/<model folder>/ (resumable model by model: the store skips what
    is done), then the cross-model table into <out>; every model reference is checked before the first loads.
    The extractor workers are started once and load each model in turn in place of the last."""
    import time

    from poolbench.driver.extractor_fleet import ExtractorFleet
    from poolbench.extractor.loading import check_model_reference
    from poolbench.results.documents.cross_model_outputs import model_folders, write_cross_model_outputs

    if len(models) < 2:
        raise PoolBenchError(f"a cross-model run needs at least two models, got {len(models)}")
    folders = model_folders(models)
    for name in models:
        check_model_reference(name, dict(cfg.model_args))
    started, timing, per_model = time.perf_counter(), {}, {}
    with ExtractorFleet(cfg.strategy_modules) as fleet:
        for name in models:
            model_cfg = cfg.model_copy(update={"model": name, "out": str(Path(cfg.out) / folders[name])})
            per_model[name] = evaluate_config(model_cfg, on_event=on_event, fleet=fleet)
            timing[f"{name}_s"] = float((per_model[name].document.get("timing") or {}).get("total_s", 0.0))
    timing["total_s"] = time.perf_counter() - started
    paths = write_cross_model_outputs(Path(cfg.out), folders, config=cfg.model_dump(mode="json") | {
        "model": list(models)}, timing=timing, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
    return ModelsResults(per_model, json.loads(paths["results"].read_text()),
                         json.loads(paths["leaderboard"].read_text()), paths)


def run_config(**options: object) -> RunConfig:
    """A RunConfig from keyword options (lists taken for tuples, paths for strings where the field is a string); a
    bad option stops in one line naming it."""
    def plain(value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    fixed = {k: tuple(plain(x) for x in v) if isinstance(v, list | tuple) else plain(v) if k == "out" else v
             for k, v in options.items()}
    try:
        return RunConfig.model_validate(fixed)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise PoolBenchError(f"{'.'.join(str(p) for p in first['loc']) or 'options'}: {first['msg']}") from None


def evaluate(model: str = EMBEDDED, *, on_event: EventSink | None = None, **options: object) -> Results:
    """`poolbench-driver run` from Python: the same options by RunConfig's field names (concepts, strategies, layers,
    corpus_size, limit, steering, out, log_samples, strategy_modules, capability_task, wandb_args, mlflow_uri, ...),
    the same files in `out`, the results as typed records (the capability stage's in the document's `capability`,
    what the stages after the run said in `messages`)."""
    cfg = run_config(model=model, **options)
    check_run_extras(cfg)
    return evaluate_config(cfg, on_event=on_event)


def pool(texts: Sequence[str], *, model: str = EMBEDDED, strategies: Sequence[str] = ("A1_mean",),
         layers: Sequence[int] | None = None, dtype: str = "auto", device: str = "auto",
         max_length: int = 256, batch_size: int = 32) -> dict[int, dict[str, np.ndarray]]:
    """Pooled vectors of `texts`, as result[layer][strategy] -> array [len(texts), hidden]; `layers` defaults to
    every layer. Strategies that learn from a labelled train split (S3, L5's TF-IDF) need a corpus: use evaluate."""
    from poolbench.corpus.passage import Passage
    from poolbench.extractor.loading import load_model
    from poolbench.pooler.concept_pooling import pool_concept, strategy_needs
    from poolbench.pooler.pooled_table import PooledTableView
    from poolbench.pooler.registry import resolve_strategies

    if not texts:
        raise PoolBenchError("pool: no texts given")
    specs = resolve_strategies(list(strategies))
    corpus_bound = [s.id for s in specs if s.supervision == "labels" or "corpus" in strategy_needs([s])]
    if corpus_bound:
        raise PoolBenchError(f"pool: {', '.join(corpus_bound)} learn from a labelled corpus; use poolbench.evaluate")
    loaded = load_model(model, dtype=dtype, device=device)
    chosen = list(range(loaded.n_layers)) if layers is None else [int(L) for L in layers]
    bad = [L for L in chosen if not 0 <= L < loaded.n_layers]
    if bad:
        raise PoolBenchError(f"pool: layers {bad} out of range (0..{loaded.n_layers - 1} for {model})")
    passages = [Passage(id=f"text-{i}", text=t, label=0, domain="api", token_count=0, matched_pair_id=None,
                        split="test", concept="api") for i, t in enumerate(texts)]
    table = pool_concept(loaded, passages, chosen, specs, batch_size=batch_size, max_length=max_length)
    view = PooledTableView(table)
    order = {p.id: i for i, p in enumerate(passages)}
    out: dict[int, dict[str, np.ndarray]] = {}
    for layer, strategy in view.cells:
        cell = view.matrix(layer, strategy)
        rows = np.argsort([order[str(pid)] for pid in cell.passage_ids])
        out.setdefault(layer, {})[strategy] = np.asarray(cell.X[rows], dtype=np.float32)
    return out


def evaluate_learning_curve(cfg: RunConfig, sizes: Sequence[int | None], *, on_event: EventSink | None = None
                            ) -> tuple[dict, Path]:
    """`cfg` at each training size (at most N train passages per class, None: the whole train split; the test split
    always whole) into <out>/n<N>/ (or <out>/all/), then the curve into <out>/learning_curve.json; the extractor
    workers are started once for every size."""
    from poolbench.atomic_write import write_json_atomic
    from poolbench.driver.extractor_fleet import ExtractorFleet
    from poolbench.results.answer.learning_curve import CURVE_FILE, learning_curve

    points = []
    with ExtractorFleet(cfg.strategy_modules) as fleet:
        for size in sizes:
            sub = cfg.model_copy(update={"train_limit": size,
                                         "out": str(Path(cfg.out) / (f"n{size}" if size is not None else "all"))})
            results = evaluate_config(sub, on_event=on_event, fleet=fleet)
            points.append((size, results.document, results.leaderboard))
    curve = learning_curve(points, rope=cfg.rope, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
    path = Path(cfg.out) / CURVE_FILE
    write_json_atomic(path, curve)
    return curve, path
