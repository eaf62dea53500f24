"""A tiny finished run on disk (results.json + pooled tables in a LocalStore) for the reliability CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer

from poolbench.cli.reliability import flash_check, power
from poolbench.corpus.passage import Passage
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.store.artifact_store import LocalStore

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
