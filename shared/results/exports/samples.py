"""`--log-samples` (lm-evaluation-harness style): per-passage held-out scores of the cells the leaderboard reports,
so a reader can audit a D1 number passage by passage (read from the per-passage score table the D1 cells stored:
the very fits the numbers come from, supervised S3 cells included; nothing is refitted), and every D2 generation
with its scores (read back from the run's stored generation tables)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from poolbench.atomic_write import write_text_atomic
from poolbench.prober.passage_scores import held_out_cells
from poolbench.store.artifact_store import ArtifactStore

SAMPLES_PROBE = "logistic"


def sample_rows(leaderboard: dict, scores: pa.Table) -> Iterator[dict]:
    """One row per held-out passage of each strategy at its leaderboard layer and concept: the leaderboard
    probe's score (the AUROC's input) and its 0/1 prediction (score > 0), as the D1 cell stored them."""
    probe = str(leaderboard.get("probe") or SAMPLES_PROBE)
    layers = {row["strategy"]: int(row["best_layer"]) for row in leaderboard["strategies"]}
    cells = held_out_cells(scores, layers, probe)
    for row in leaderboard["strategies"]:
        strategy = row["strategy"]
        for concept in row["per_concept"]:
            cell = cells.get((concept, strategy))
            if cell is None:
                continue
            for passage_id, group, label, score in zip(cell.passage_ids, cell.pair_ids, cell.labels, cell.scores,
                                                       strict=True):
                yield {"concept": concept, "strategy": strategy, "layer": layers[strategy], "probe": probe,
                       "passage_id": str(passage_id), "group": str(group), "label": int(label),
                       "score": float(score), "prediction": int(score > 0)}


def write_samples(leaderboard: dict, scores: pa.Table, path: Path) -> int:
    """Write the sample rows as JSONL (atomically) and return how many there are."""
    lines = [json.dumps(row) for row in sample_rows(leaderboard, scores)]
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
