"""A tiny finished run on disk (results.json + pooled tables in a LocalStore) for the reliability CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import typer

from poolbench.cli.reliability import flash_check, power
from poolbench.corpus.passage import Passage
from poolbench.pooler.iti import FRACTION_META, HEADS_META, ITIHeadTableBuilder, head_table_key
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.store.local import LocalStore

STRATEGIES = {"A1_mean": 2.0, "P1_last": 0.6, "A2_max": 0.0}  # signal strength per strategy
LAYERS = (0, 1)


def make_run(root: Path, concepts: tuple[str, ...] = ("negation", "sarcasm"), n_train_pairs: int = 32,
             n_test_pairs: int = 30, d: int = 8) -> Path:
    store = LocalStore(root / "store")
    rng = np.random.default_rng(0)
    artifacts, cells = {}, []
    for concept in concepts:
        passages = [Passage(id=f"{concept}-{split}{i}-{label}", text="t", label=label, domain="d",
                            token_count=1, matched_pair_id=f"{concept}-{split}{i}", split=split,
                            concept=concept)
                    for split, n in (("train", n_train_pairs), ("test", n_test_pairs)) for i in range(n)
                    for label in (1, 0)]
        builder = PooledTableBuilder(passages, hidden_size=d)
        y = np.array([p.label for p in passages])
        vectors = rng.normal(size=(len(LAYERS), len(STRATEGIES), len(passages), d)).astype(np.float32)
        for si, strength in enumerate(STRATEGIES.values()):
            vectors[:, si, :, 0] += strength * y
        builder.add(vectors, list(LAYERS), list(STRATEGIES), [p.id for p in passages],
                    np.zeros((len(STRATEGIES), len(passages)), dtype=bool))
        key = f"pooled-{concept}"
        store.put_table(key, builder.table())
        artifacts[concept] = {"pooled": key, "d1": f"d1-{concept}"}
        cells += [{"concept": concept, "layer": L, "strategy": s, "probe": "logistic",
                   "cv_auroc": 0.5 + L / 10, "test_auroc": 0.5, "ci_low": 0.4, "ci_high": 0.6}
                  for L in LAYERS for s in STRATEGIES]
    run = root / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "config": {"store": str(root / "store")}, "strategies": [{"id": s} for s in STRATEGIES],
        "artifacts": artifacts, "cells": cells}))
    return run


def cli() -> typer.Typer:
    """The commands registered the way the lead registers them in poolbench.cli.app."""
    app = typer.Typer()
    app.command("power")(power)
    app.command("flash-check")(flash_check)
    return app


def s3_concept(concept: str, n_train_pairs: int = 40, n_test_pairs: int = 30, seed: int = 0
               ) -> tuple[pa.Table, pa.Table]:
    """One concept's PooledTable (A1_mean, S3_iti_probe at layer 0) and S3's ITIHeadTable, 4 heads, where the
    all-heads row and fold-wise head selection disagree: head 0's pooled vector carries the label but its
    output does not, so selection (top 1 of 4 heads, on head outputs) never picks it; head 1's output carries
    the label and its pooled vector is noise. The all-heads row (the mean of the 4) keeps head 0's signal."""
    rng = np.random.default_rng(seed)
    passages = [Passage(id=f"{concept}-{split}{i}-{label}", text="t", label=label, domain="d", token_count=1,
                        matched_pair_id=f"{concept}-{split}{i}", split=split, concept=concept)
                for split, n in (("train", n_train_pairs), ("test", n_test_pairs)) for i in range(n)
                for label in (1, 0)]
    ids, sign = [p.id for p in passages], 2.0 * np.array([p.label for p in passages]) - 1.0
    n, d, n_heads, head_dim = len(passages), 6, 4, 2
    per_head = rng.normal(size=(n, n_heads, d))
    per_head[:, 0, 0] += 3.0 * sign
    outputs = rng.normal(size=(n, n_heads, head_dim))
    outputs[:, 1, 0] += 3.0 * sign
    a1 = rng.normal(size=(n, d))
    a1[:, 0] += 1.0 * sign
    builder = PooledTableBuilder(passages, hidden_size=d)
    builder.add(np.stack([a1, per_head.mean(axis=1)])[None].astype(np.float32), [0], ["A1_mean", "S3_iti_probe"],
                ids, np.zeros((2, n), dtype=bool))
    heads = ITIHeadTableBuilder(d)
    heads.add("S3_iti_probe", [0], ids, per_head[None], outputs[None])
    return (builder.table({f"S3_iti_probe{HEADS_META}": str(n_heads)}),
            heads.table({f"S3_iti_probe{FRACTION_META}": "0.25"}))


def make_s3_run(root: Path, concept: str = "negation", seed: int = 0) -> Path:
    """A finished run of A1_mean and S3_iti_probe on one concept, its head table stored beside the vectors."""
    store = LocalStore(root / "store")
    pooled, heads = s3_concept(concept)
    store.put_table("pooled-s3", pooled)
    store.put_table(head_table_key("pooled-s3"), heads)
    run = root / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "config": {"store": str(root / "store")}, "seed": seed,
        "strategies": [{"id": "A1_mean"}, {"id": "S3_iti_probe"}],
        "artifacts": {concept: {"pooled": "pooled-s3", "d1": "d1-s3"}},
        "cells": [{"concept": concept, "layer": 0, "strategy": s, "probe": "logistic", "cv_auroc": 0.7,
                   "test_auroc": 0.7, "ci_low": 0.6, "ci_high": 0.8} for s in ("A1_mean", "S3_iti_probe")]}))
    return run
