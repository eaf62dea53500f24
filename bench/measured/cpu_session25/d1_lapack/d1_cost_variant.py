"""bench/d1_cost.py with the batched solver's float32 CPU factors from torch (variant A: 4865a52's code path) or
from lapack_factors (variant B). Run from the project root: python <this file> A|B <d1_cost's arguments>."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from poolbench.prober import batched_logistic

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # bench/, for d1_cost and bench_io


def main() -> None:
    if sys.argv.pop(1) == "A":
        batched_logistic.factor_in_place = lambda A: torch.linalg.cholesky(A)  # type: ignore[assignment]
        batched_logistic.solve = lambda L, t: torch.cholesky_solve(t, L)  # type: ignore[assignment]
    import d1_cost

    d1_cost.main()


if __name__ == "__main__":
    main()
