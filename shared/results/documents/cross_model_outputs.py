"""A run over several models on disk: each model's folder holds what a single-model run writes, and the run
folder's own results.json / leaderboard.json hold the cross-model table (kind "cross_model")."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from poolbench.atomic_write import write_json_atomic, write_text_atomic
from poolbench.defaults import EMBEDDED, EMBEDDED_GEMMA
from poolbench.errors import PoolBenchError
from poolbench.provenance import git_hash, package_versions, utc_now
from poolbench.results.answer.answer import ANSWER_FILE, read_answer
from poolbench.results.answer.cross_model import ModelBoard, cross_model_table
from poolbench.results.documents.document import RESULTS_SCHEMA_VERSION, run_stamp
from poolbench.results.documents.tidy import to_csv

CROSS_MODEL_KIND = "cross_model"
BUILT_IN_MODELS = {EMBEDDED: "SmolLM2-135M-Instruct", EMBEDDED_GEMMA: "Gemma-3-270M"}  # what the names load
WIDE_COLUMNS = ["strategy", "family", "mean_rank", "model", "mean_d1", "ci_low", "ci_high", "rank", "best_layer",
                "relative_depth"]


def model_folder(name: str) -> str:
    """The folder a model's results go in: its name with anything but letters, digits, '.', '_' and '-' as '_'."""
    folder = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")
    return folder or "model"


def model_folders(models: Sequence[str]) -> dict[str, str]:
    """Model name -> folder; a model named twice, or two names sharing a folder, stop the run in one line."""
    seen: dict[str, str] = {}
    for name in models:
        folder = model_folder(name)
        if name in seen:
            raise PoolBenchError(f"--model '{name}' is given twice")
        if folder in seen.values():
            other = next(n for n, f in seen.items() if f == folder)
            raise PoolBenchError(f"--model '{name}' and '{other}' would share the results folder '{folder}'")
        seen[name] = folder
    return seen


def is_cross_model(document: dict) -> bool:
    return document.get("kind") == CROSS_MODEL_KIND


def read_boards(run_dir: Path, folders: dict[str, str]) -> list[ModelBoard]:
    """Each model's leaderboard and depth as its own folder holds them (the single-model files)."""
    boards = []
    for name, folder in folders.items():
        board_path = run_dir / folder / "leaderboard.json"
        if not board_path.is_file():
            raise PoolBenchError(f"no leaderboard.json in {run_dir / folder} (model '{name}')")
        try:
            leaderboard = json.loads(board_path.read_text())
        except ValueError as exc:
            raise PoolBenchError(f"{board_path} is not valid JSON ({exc})") from None
        model = leaderboard.get("model") or {}
        if "n_layers" not in model:
            raise PoolBenchError(f"{board_path}: no model.n_layers (needed for relative depth)")
        model_id = BUILT_IN_MODELS.get(str(model.get("model_id", name)), str(model.get("model_id", name)))
        answer_path = run_dir / folder / ANSWER_FILE
        verdicts = read_answer(answer_path).verdicts if answer_path.is_file() else None
        boards.append(ModelBoard(name, model_id, int(model["n_layers"]), leaderboard, folder,
                                 None if verdicts is None else verdicts.best.strategy,
                                 None if verdicts is None else {c.strategy: c.verdict for c in verdicts.comparisons}))
    return boards


def cross_model_rows(table: dict) -> list[dict]:
    """The table as tidy rows, one per (strategy, model), for a CSV a spreadsheet opens."""
    return [{"strategy": row["strategy"], "family": row.get("family", ""), "mean_rank": row["mean_rank"],
             "model": model, **{k: cell[k] for k in WIDE_COLUMNS[4:]}}
            for row in table["rows"] for model, cell in row["per_model"].items()]


def write_cross_model_outputs(run_dir: Path, folders: dict[str, str], *, config: dict, timing: dict[str, float],
                              n_bootstrap: int, seed: int, stamp: str | None = None) -> dict[str, Path]:
    """results.json and leaderboard.json of the run folder (and their stamped copies, and cross_model.csv):
    the cross-model table with where each model's own files are; written atomically, after every model's."""
    stamp = stamp or run_stamp()
    boards = read_boards(run_dir, folders)
    table = cross_model_table(boards, n_bootstrap=n_bootstrap, seed=seed)
    models = [{"name": b.name, "model_id": b.model_id, "n_layers": b.n_layers, "folder": b.folder,
               "results": f"{b.folder}/results.json", "leaderboard": f"{b.folder}/leaderboard.json"}
              for b in boards]
    results = {"schema_version": RESULTS_SCHEMA_VERSION, "kind": CROSS_MODEL_KIND, "date": utc_now(),
               "git_hash": git_hash(), "versions": package_versions(), "config": config, "seed": seed,
               "models": models, "timing": timing, "cross_model": table}
    leaderboard = {"kind": CROSS_MODEL_KIND, "models": models, "cross_model": table, "date": results["date"],
                   "git_hash": results["git_hash"]}
    paths = {"results_stamped": run_dir / f"results_{stamp}.json",
             "leaderboard_stamped": run_dir / f"leaderboard_{stamp}.json",
             "results": run_dir / "results.json", "leaderboard": run_dir / "leaderboard.json",
             "cross_model_csv": run_dir / "cross_model.csv"}
    for name, document in (("results", results), ("leaderboard", leaderboard)):
        write_json_atomic(paths[f"{name}_stamped"], document)
        write_json_atomic(paths[name], document)
    write_text_atomic(paths["cross_model_csv"], to_csv(cross_model_rows(table), WIDE_COLUMNS))
    return paths
