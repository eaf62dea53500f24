"""`--log-samples` (lm-evaluation-harness style): per-passage held-out scores of the cells the leaderboard reports,
so a reader can audit a D1 number passage by passage (recomputed from the stored pooled vectors, after the run),
and every D2 generation with its scores (read back from the run's stored generation tables)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from poolbench.atomic_write import write_text_atomic
from poolbench.pooler.pooled_table import PooledTableView, read_pooled_table
from poolbench.prober.flash import flash_subset, parse_fraction
from poolbench.prober.probes import make_probe
from poolbench.store.artifact_store import ArtifactStore

SAMPLES_PROBE = "logistic"


def sample_rows(results: dict, leaderboard: dict, store: ArtifactStore) -> Iterator[dict]:
    """One row per held-out passage of each strategy at its leaderboard layer and concept: the logistic probe
    fitted on train exactly as D1 fits it, its score (the AUROC's input) and its 0/1 prediction. Supervised (S3)
    cells choose heads inside each fold and are not replayed here."""
    config = results.get("config") or {}
    seed, flash, n_folds = int(config.get("seed", 0)), config.get("flash"), int(config.get("n_folds", 5))
    views: dict[str, PooledTableView] = {}
    for row in leaderboard["strategies"]:
        if row.get("supervision") == "labels":
            continue
        strategy, layer = row["strategy"], int(row["best_layer"])
        for concept in row["per_concept"]:
            if concept not in views:
                views[concept] = PooledTableView(read_pooled_table(store, results["artifacts"][concept]["pooled"]))
            cell = views[concept].matrix(layer, strategy)
            train_rows = np.flatnonzero(cell.split == "train")
            if flash is not None:
                kept = flash_subset(cell.y[train_rows], cell.groups[train_rows], parse_fraction(flash), seed=seed,
                                    concept=concept, min_per_class=n_folds)
                train_rows = train_rows[kept]
            train, test = cell.take(train_rows), cell.subset("test")
            with threadpool_limits(limits=1, user_api="blas"):  # as D1 fits it, to the last digit
                probe = make_probe(SAMPLES_PROBE, seed).fit(train.X, train.y)
                scores = probe.decision_function(test.X)
            for passage_id, group, label, score in zip(test.passage_ids, test.groups, test.y, scores, strict=True):
                yield {"concept": concept, "strategy": strategy, "layer": layer, "probe": SAMPLES_PROBE,
                       "passage_id": str(passage_id), "group": str(group), "label": int(label),
                       "score": float(score), "prediction": int(score > 0)}


def write_samples(results: dict, leaderboard: dict, store: ArtifactStore, path: Path) -> int:
    """Write the sample rows as JSONL (atomically) and return how many there are."""
    lines = [json.dumps(row) for row in sample_rows(results, leaderboard, store)]
    write_text_atomic(path, "".join(f"{line}\n" for line in lines))
    return len(lines)


def generation_rows(results: dict, store: ArtifactStore) -> Iterator[dict]:
    """One row per generation of every D2 cell (steered at each alpha, and the prompted baseline): its prompt,
    seed, text and every scorer's score, from the generations artifact the cell stored."""
    for record in results.get("d2") or []:
        key = record.get("generations_key")
        if not key:
            continue
        table = store.get_table(key).to_pylist()
        for row in table:
            scores = {name.removeprefix("score_"): value for name, value in row.items() if name.startswith("score_")}
            yield {"concept": record["concept"], "strategy": record["strategy"], "layer": record["layer"],
                   "kind": row["kind"], "alpha": row["alpha"], "prompt_index": row["prompt_index"],
                   "seed": row["seed"], "prompt": row["prompt"], "text": row["text"], "n_tokens": row["n_tokens"],
                   "scores": scores}


def write_generations(results: dict, store: ArtifactStore, path: Path) -> int:
    """Write the generation rows as JSONL (atomically) and return how many there are."""
    lines = [json.dumps(row) for row in generation_rows(results, store)]
    write_text_atomic(path, "".join(f"{line}\n" for line in lines))
    return len(lines)
