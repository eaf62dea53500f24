"""What a run computes after its last D1 result, timed on a finished run folder: the lexical baselines (per concept
and per tier), D1 by tier and by density / placement from the stored held-out scores, and the answer's verdicts
with their paired pair bootstraps. No model and no Ray: the run folder's results.json, leaderboard.json and
passage_scores.arrow, and the corpus the run names.

Each repeat starts cold (the pair-resample memo emptied), and the JSON holds a sha256 of every record the stages
made, so two commits' runs over the same folder say whether they computed the same numbers. Writes
bench/results/after_d1.json (or --out).

    .venv/bin/python bench/after_d1.py --run runs/default
    .venv/bin/python bench/after_d1.py --run <a --corpus-size full run> --repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from bench_io import RESULTS, run_header, write_result

from poolbench.corpus.source import open_corpus
from poolbench.driver import breakdowns
from poolbench.prober import auroc as auroc_module
from poolbench.prober.passage_scores import concat_scores
from poolbench.records.d1 import D1CellRecord
from poolbench.results.answer.answer import answer_json, build_answer
from poolbench.results.answer.passage_table import read_run_scores, write_run_scores


def _digest(records: object) -> str:
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()


def _lexical(passages: dict, n_bootstrap: int, seed: int) -> tuple[list, list]:
    fits = breakdowns.lexical_fits(passages) if hasattr(breakdowns, "lexical_fits") else None  # older commits
    extra = {} if fits is None else {"fits": fits}
    return (breakdowns.lexical_baselines(passages, n_bootstrap=n_bootstrap, seed=seed, **extra),
            breakdowns.lexical_by_tier(passages, n_bootstrap=n_bootstrap, seed=seed, **extra))


def one_pass(run: Path, passages: dict, records: list, results: dict, leaderboard: dict, n_bootstrap: int,
             seed: int) -> tuple[dict, dict, int]:
    memo = getattr(auroc_module, "_WEIGHTS", None)
    if memo is not None:
        memo.clear()
    seconds, made = {}, {}
    start = time.perf_counter()
    scores = read_run_scores(run)
    seconds["read_scores"] = time.perf_counter() - start
    # The driver joins the concepts' score tables, writes the run folder's copy and the answer reads it back.
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        written = write_run_scores(concat_scores([scores]), Path(scratch))
        file_bytes = written.stat().st_size
        scores = read_run_scores(Path(scratch))
    seconds["join_write_read_scores"] = time.perf_counter() - start
    stages = {
        "lexical": lambda: [[r.to_dict() for r in part] for part in _lexical(passages, n_bootstrap, seed)],
        "d1_by_tier": lambda: [r.to_dict() for r in breakdowns.d1_by_tier(scores, passages, records,
                                                                           n_bootstrap=n_bootstrap, seed=seed)],
        "d1_by_bucket": lambda: [r.to_dict() for r in breakdowns.d1_by_bucket(scores, passages, records,
                                                                               n_bootstrap=n_bootstrap, seed=seed)],
        "answer": lambda: json.loads(answer_json(build_answer(results, leaderboard, scores))),
    }
    for name, stage in stages.items():
        start = time.perf_counter()
        made[name] = _digest(stage())
        seconds[name] = time.perf_counter() - start
    return seconds, made, file_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished run's folder")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "after_d1.json")
    args = parser.parse_args()
    results = json.loads((args.run / "results.json").read_text())
    leaderboard = json.loads((args.run / "leaderboard.json").read_text())
    config = results["config"]
    corpus = open_corpus(config.get("corpus") or "embedded", config.get("corpus_size") or "small",
                         config.get("concepts"))
    passages = {c: list(corpus.passages(c)) for c in corpus.concepts}
    records = [D1CellRecord.from_dict(r) for r in results["cells"]]
    n_bootstrap, seed = int(config.get("n_bootstrap") or 1000), int(config.get("seed") or 0)
    repeats = [one_pass(args.run, passages, records, results, leaderboard, n_bootstrap, seed)
               for _ in range(args.repeats)]
    digests = {d["answer"] + d["d1_by_tier"] for _, d, _ in repeats}
    if len(digests) != 1:
        raise SystemExit("after_d1: two repeats over one run folder made different records")
    best = {name: min(s[name] for s, _, _ in repeats) for name in repeats[0][0]}
    result = run_header("after_d1", args, "cpu") | {
        "run": str(args.run), "concepts": len(passages), "cells": len(records),
        "passages": sum(len(p) for p in passages.values()), "seconds_best": best,
        "seconds_each": [s for s, _, _ in repeats], "total_best_s": sum(best.values()),
        "run_scores_file_bytes": repeats[0][2],
        "records_sha256": repeats[0][1]}
    print(json.dumps({"seconds_best": best, "total_best_s": result["total_best_s"]}, indent=1))
    write_result(result, args.out)


if __name__ == "__main__":
    main()
