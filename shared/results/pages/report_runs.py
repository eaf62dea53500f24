"""The runs a report reads: each run folder's results.json and leaderboard.json as typed records, plus the D2
per-alpha intervals recomputed from the per-prompt scores in the run's store (results.json keeps only means)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from poolbench.errors import PoolBenchError
from poolbench.records.base import RecordError
from poolbench.records.breakdowns import BucketAurocRecord
from poolbench.records.d1 import D1CellRecord
from poolbench.records.lexical import LexicalBaselineRecord
from poolbench.records.scorer import ScorerValidity
from poolbench.records.steering import D2Record, D3Record
from poolbench.results.answer.answer import RunAnswer, run_answer
from poolbench.results.answer.leaderboard import PRIMARY_PROBE, build_leaderboard
from poolbench.results.answer.ranking import CI_LEVEL
from poolbench.steerer.d2 import paired_delta
from poolbench.store.url import open_store, run_store_url


@dataclass(frozen=True)
class Run:
    """One run folder's documents and their typed records; `name` labels it (the model id) when a report
    covers several runs."""

    name: str
    results: dict
    leaderboard: dict
    cells: list[D1CellRecord]
    d2: list[D2Record]  # every D2 record, null steering vectors included
    d3: list[D3Record]
    scorers: list[ScorerValidity]
    alpha_ci: dict[tuple[str, str, int], list[tuple[float, float]]] = field(default_factory=dict)
    alpha_ci_note: str | None = None  # why per-alpha intervals are missing, when they are
    lexical: list[LexicalBaselineRecord] = field(default_factory=list)
    buckets: list[BucketAurocRecord] = field(default_factory=list)
    answer: RunAnswer | None = None  # the run's answer.json (built from its documents for older runs)


def load_runs(path: Path, store: str | None = None) -> list[Run]:
    """A run folder, or a folder of run folders (one per model): every results.json found, one level deep.
    `store` overrides where the runs' generations are read from (default: the store each run recorded)."""
    folders = [path] if (path / "results.json").is_file() else sorted(
        p for p in path.iterdir() if (p / "results.json").is_file()) if path.is_dir() else []
    if not folders:
        raise PoolBenchError(f"no results.json in {path} (nor in its subfolders)")
    runs = []
    for folder in folders:
        try:
            results = json.loads((folder / "results.json").read_text())
        except ValueError as exc:
            raise PoolBenchError(f"{folder / 'results.json'} is not valid JSON ({exc})") from exc
        if not results.get("cells"):
            raise PoolBenchError(f"{folder / 'results.json'} has no cells")
        try:
            cells = [D1CellRecord.from_dict(c) for c in results["cells"]]
            d2, d3, scorers = d2_records(results), d3_records(results), scorer_records(results)
            lexical = [LexicalBaselineRecord.from_dict(r) for r in results.get("lexical_baseline") or []]
            buckets = [BucketAurocRecord.from_dict(r) for r in results.get("d1_by_bucket") or []]
        except RecordError as exc:
            raise PoolBenchError(f"{folder / 'results.json'}: {exc}") from None
        board_path = folder / "leaderboard.json"
        board = json.loads(board_path.read_text()) if board_path.is_file() else build_leaderboard(cells)
        alpha_ci, note = alpha_intervals(results, d2, store)
        runs.append(Run((results.get("model") or {}).get("model_id") or folder.name, results, board, cells, d2, d3,
                        scorers, alpha_ci, note, lexical, buckets, run_answer(folder, results, board)))
    return runs


def _listed(results: dict, *keys: str) -> list[dict]:
    """A section that runs kept as a list or as a dict by concept, under the first of `keys` present."""
    found = next((results[k] for k in keys if results.get(k)), None) or []
    if isinstance(found, dict):
        found = list(found.values())
    return [r for r in found if isinstance(r, dict)]


def d2_records(results: dict) -> list[D2Record]:
    """Every D2 record, wherever a run put them (results["d2"] or results["steering"]["d2"])."""
    found = _listed(results, "d2") or _listed(results.get("steering") or {}, "d2")
    return [D2Record.from_dict(r) for r in found]


def d3_records(results: dict) -> list[D3Record]:
    return [D3Record.from_dict(r) for r in _listed(results, "d3") or _listed(results.get("steering") or {}, "d3")]


def scorer_records(results: dict) -> list[ScorerValidity]:
    """Classifier-B validity records (results["scorers"], a list or a dict by concept)."""
    return [ScorerValidity.from_dict(r) for r in _listed(results, "scorers", "scorer_validity")]


def _store_url(results: dict, override: str | None) -> str:
    """The store a run wrote to: the override, else the one its results.json records (store.url.run_store_url)."""
    return override or run_store_url(results)


def alpha_intervals(results: dict, d2: Sequence[D2Record], store: str | None = None
                    ) -> tuple[dict[tuple[str, str, int], list[tuple[float, float]]], str | None]:
    """Per steering cell, the CI of the mean concept score at each alpha on the report half of the prompts,
    resampling prompts as Delta(alpha*) does; from the per-prompt scores in the store (results.json keeps means)."""
    cells = [r for r in d2 if r.per_alpha and r.generations_key and r.report_prompts]
    if not cells:
        return {}, None
    config = results.get("steering", {}).get("steering_config", {})
    n_bootstrap, seed = int(config.get("n_bootstrap", 1000)), int(config.get("seed", 0))
    try:
        opened = open_store(_store_url(results, store))
        out = {}
        for r in cells:
            table = opened.get_table(str(r.generations_key)).to_pydict()
            steered = [i for i, kind in enumerate(table["kind"]) if kind == "steered"]
            by_alpha: dict[float, dict[int, float]] = defaultdict(dict)
            for i in steered:
                by_alpha[float(table["alpha"][i])][int(table["prompt_index"][i])] = table[f"score_{r.concept}"][i]
            intervals = []
            for alpha in r.alphas:
                values = np.array([by_alpha[float(alpha)][p] for p in r.report_prompts])
                ci = paired_delta(values, np.zeros_like(values), n_bootstrap=n_bootstrap, seed=seed,
                                  level=CI_LEVEL)
                intervals.append((float(ci["ci_low"]), float(ci["ci_high"])))
            out[(r.concept, r.strategy, r.layer)] = intervals
    except (PoolBenchError, KeyError, OSError) as exc:
        return {}, f"per-α intervals need the run's generations, which could not be read ({exc})"
    return out, None


def primary_cells(run: Run) -> dict[tuple[str, int, str], D1CellRecord]:
    return {(c.strategy, c.layer, c.concept): c for c in run.cells if c.probe == PRIMARY_PROBE}


def friedman_of(run: Run) -> dict | None:
    friedman = (run.results.get("reliability") or {}).get("friedman") or run.leaderboard.get("friedman")
    return friedman if friedman and friedman.get("average_ranks") else None
