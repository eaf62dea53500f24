"""The capability stage over a finished run (`capability`, `run --capability-task`, `poolbench.evaluate`): lm-eval
scores each cell against the run's own model and stored vectors, served (poolbench.http.app) on a free loopback port
behind a random bearer token, started once for every cell and stopped after."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from pathlib import Path

from poolbench.capability.measure import CapabilityError, CapabilityRecord, measure_capability


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_model(doc: dict, run_dir: Path) -> tuple[str, str]:
    """The run's model id and the local folder lm-eval tokenizes with, or one line saying why there is none."""
    from poolbench.extractor.loading import local_model_dir

    model = str((doc.get("config") or {}).get("model") or "")
    tokenizer = local_model_dir(model) if model else None
    if tokenizer is None:
        raise CapabilityError(f"{run_dir}/results.json: config.model '{model}' is not a local model lm-eval can "
                              "tokenize with")
    return model, str(tokenizer)


def measure_run_capability(run_dir: Path, doc: dict, cells: Sequence[tuple[str, str, int, float]], task: str,
                           task_dir: Path, *, metric: str = "acc", limit: int | None = None,
                           n_bootstrap: int = 2000, seed: int = 0) -> list[CapabilityRecord]:
    """Each (concept, strategy, layer, alpha) cell's capability record: lm-eval's local-completions model against
    the run's own service, unsteered and at alpha."""
    import ray
    from ray import serve

    from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray
    from poolbench.http.app import start_serve
    from poolbench.http.settings import ServiceSettings, vectors_of_run

    model, tokenizer = run_model(doc, run_dir)
    token = secrets.token_hex(16)
    settings = ServiceSettings(models=(model,), token=token, **vectors_of_run(run_dir))
    if not ray.is_initialized():
        init_local_ray(runtime_env=LOOPBACK_RUNTIME_ENV)
    base = start_serve(settings, port=_free_port())
    try:
        return [measure_capability(base, model, tokenizer, task, task_dir, concept=concept, strategy=strategy,
                                   layer=layer, alpha=alpha, metric=metric, token=token, limit=limit,
                                   n_bootstrap=n_bootstrap, seed=seed) for concept, strategy, layer, alpha in cells]
    finally:
        serve.shutdown()


def run_capability_stage(run_dir: Path, task: str, task_dir: Path, *, stamped: tuple[Path, ...] = (),
                         n_bootstrap: int = 2000, seed: int = 0) -> list[str]:
    """`run --capability-task`: every steered cell of the finished run folder at its alpha* and at 0, recorded in
    the run's documents and answer; the lines to print."""
    from poolbench.capability.records import record_capability, record_sentence, steered_cells
    from poolbench.results.exports.vector_export import read_run

    doc = read_run(run_dir)
    cells = steered_cells(doc)
    if not cells:
        return [f"capability: no steered cell with an alpha* > 0 in {run_dir}; nothing to score on {task}"]
    records = measure_run_capability(run_dir, doc, cells, task, task_dir, n_bootstrap=n_bootstrap, seed=seed)
    record_capability(run_dir, records, stamped)
    return [f"capability: {record_sentence(r.to_dict())}" for r in records]
