"""Interleaved A/B in one process: the batched solver's float32 CPU factors from torch (A) or lapack_factors (B),
each cell by both (order alternating by round), one torch thread; d1_cost's kind of synthetic cells (d 4,096,
1,400 train / 600 test passages, 4 lexical types, reliability on). Prints each cell's seconds, whether any record
differs and the largest score gap. python ab_lapack.py CELLS ROUNDS"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from poolbench.prober import batched_logistic
from poolbench.prober.batched_cell import batched_d1_cell

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/
import d1_cost

VARIANTS = {"A": (lambda A: torch.linalg.cholesky(A), lambda L, t: torch.cholesky_solve(t, L)),
            "B": (batched_logistic.factor_in_place, batched_logistic.solve)}


def cells_data(cells: int, d: int = 4096) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    items = d1_cost.passages(1400, 600)
    rng = np.random.default_rng(0)
    y = np.array([p.label for p in items])
    dom = np.array([int(p.domain[1:]) for p in items])
    train = np.array([p.split == "train" for p in items])
    groups = np.array([p.matched_pair_id for p in items])
    scale = rng.uniform(0.3, 3.0, size=d).astype(np.float32)
    Xs = []
    for s in range(cells):
        direction = rng.normal(size=d).astype(np.float32) / np.sqrt(d)
        offsets = rng.normal(size=(d1_cost.DOMAINS, d)).astype(np.float32) * 0.3
        X = rng.normal(size=(len(items), d)).astype(np.float32) * scale + offsets[dom]
        Xs.append(X + np.outer(y, direction) * (0.5 + 0.1 * (s + 10)) * np.sqrt(d) * 0.05)
    return Xs, y, dom, train, groups


def main() -> None:
    cells, rounds = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    Xs, y, dom, tr, groups = cells_data(cells)
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(rounds):
        for c, X in enumerate(Xs):
            out = {}
            for v in ("A", "B") if r % 2 == 0 else ("B", "A"):
                batched_logistic.factor_in_place, batched_logistic.solve = VARIANTS[v]  # type: ignore[assignment]
                start = time.perf_counter()
                out[v] = batched_d1_cell(X[tr], y[tr], groups[tr], X[~tr], y[~tr], groups[~tr],
                                         types_train=dom[tr].astype(str))
                times[v].append(time.perf_counter() - start)
            (ra, rel_a), (rb, rel_b) = out["A"], out["B"]
            la, lb = ra.probes["logistic"], rb.probes["logistic"]
            print(f"round {r} cell {c}: A {times['A'][-1]:.2f} s, B {times['B'][-1]:.2f} s; cv {la.cv_auroc!r} vs "
                  f"{lb.cv_auroc!r}; test {la.test_auroc!r} vs {lb.test_auroc!r}", flush=True)
            print("   reliability fields that differ:", sorted(k for k in rel_a if rel_a[k] != rel_b[k]))
            print("   oof max |diff|", float(np.max(np.abs(la.oof_scores - lb.oof_scores))), "test",
                  float(np.max(np.abs(la.test_scores - lb.test_scores))), "scale", float(np.max(np.abs(la.oof_scores))))
    for v in "AB":
        print(v, "median s a cell", np.median(times[v]), "all", [round(t, 2) for t in times[v]])


if __name__ == "__main__":
    main()
