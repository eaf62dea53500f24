"""Steered generation on the steering stage's batch shape: a cell's whole alpha grid x prompts in one batch
(per-row deltas) vs one batch per alpha, and steered vs unsteered tokens/s in the same batch shape.

All arms generate the same prompts with the same per-prompt seeds; tokens/s counts generated tokens only.
`identical` counts rows whose continuation is the same token for token in both arms of a comparison.
Prints a table and writes bench/results/generate-<model>.json.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_io import RESULTS, run_header, write_result
from rich.console import Console
from rich.table import Table

from poolbench.steerer.backend import Generation, GenerationSettings
from poolbench.steerer.prompts import load_prompts
from poolbench.steerer.run import prompt_seeds
from poolbench.steerer.vector import DEFAULT_ALPHAS
from poolbench.steerer.worker import SteeringWorker


def timed_arms(arms: dict[str, Callable[[], list[Generation]]], repeats: int,
               ) -> dict[str, tuple[list[Generation], float]]:
    """Each arm's answer and best wall time over `repeats` rounds, the arms interleaved within a round, so load
    from other processes on a shared machine falls on every arm alike and the minimum is the least disturbed."""
    best: dict[str, tuple[list[Generation], float]] = {}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - start
            if name not in best or seconds < best[name][1]:
                best[name] = (out, seconds)
    return best


def arm(gens: list[Generation], seconds: float) -> dict:
    tokens = sum(len(g.token_ids) for g in gens)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def same(a: list[Generation], b: list[Generation]) -> str:
    return f"{sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))}/{len(a)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--layer", type=int, default=None, help="default: the middle layer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    worker = SteeringWorker(args.model)
    m = worker.loaded
    layer = m.n_layers // 2 if args.layer is None else args.layer
    prompts = load_prompts(None, args.prompts)
    fmt = worker.prompt_format()
    n = len(prompts)
    seeds = prompt_seeds(n, 0)
    direction = np.random.default_rng(0).normal(size=m.hidden_size).astype(np.float32)
    unit = worker.residual_norm(prompts, layer) * direction / np.linalg.norm(direction)
    alphas = DEFAULT_ALPHAS
    deltas = [None if a == 0 else (a * unit).astype(np.float32) for a in alphas]
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens)
    worker.generate(prompts[:2], layer=layer, delta=deltas[1], seeds=seeds[:2], settings=settings,
                    prompt_format=fmt)  # warm-up

    rows = [p for _ in alphas for p in prompts]
    row_deltas = [d for d in deltas for _ in prompts]
    row_seeds = seeds * len(alphas)
    # Same batch shape (alphas x prompts rows) for the last two: all steered at the largest alpha vs none (no hook).
    runs = timed_arms({
        "grid": lambda: worker.generate_rows(rows, layer=layer, deltas=row_deltas, seeds=row_seeds,
                                             settings=settings, prompt_format=fmt),
        "per_alpha": lambda: [g for d in deltas for g in worker.generate(
            prompts, layer=layer, delta=d, seeds=seeds, settings=settings, prompt_format=fmt)],
        "steered": lambda: worker.generate_rows(rows, layer=layer, deltas=[deltas[-1]] * len(rows), seeds=row_seeds,
                                                settings=settings, prompt_format=fmt),
        "plain": lambda: worker.generate_rows(rows, layer=layer, deltas=[None] * len(rows), seeds=row_seeds,
                                              settings=settings, prompt_format=fmt),
    }, args.repeats)
    (grid, t_grid), (per_alpha, t_per_alpha) = runs["grid"], runs["per_alpha"]
    (steered, t_steered), (plain, t_plain) = runs["steered"], runs["plain"]

    result = run_header("generate", args, m.device)
    result.update({
        "model_id": m.model_id, "layer": layer, "alphas": list(alphas), "prompts": n, "rows": len(rows),
        "prompt_format": fmt,
        "alpha_grid_one_batch": arm(grid, t_grid), "one_batch_per_alpha": arm(per_alpha, t_per_alpha),
        "grid_speedup": round(t_per_alpha / t_grid, 2), "grid_identical": same(grid, per_alpha),
        "steered_same_shape": arm(steered, t_steered), "unsteered_same_shape": arm(plain, t_plain),
        "steering_cost": round(t_steered / t_plain - 1, 3), "load_average_1m": os.getloadavg()[0],
    })
    table = Table(title=f"generate on {m.model_id} ({len(rows)} rows = {len(alphas)} alphas x {n} prompts, "
                        f"{args.max_new_tokens} new tokens, {args.threads} threads)")
    for col in ("arm", "tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    arms = (("alpha grid, one batch", "alpha_grid_one_batch"), ("one batch per alpha", "one_batch_per_alpha"),
            ("steered (same shape)", "steered_same_shape"), ("unsteered (same shape)", "unsteered_same_shape"))
    for name, key in arms:
        r = result[key]
        table.add_row(name, str(r["tokens"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}")
    Console().print(table)
    Console().print(f"grid speed-up {result['grid_speedup']:.2f}x (identical continuations "
                    f"{result['grid_identical']}); "
                    f"steering costs {100 * result['steering_cost']:+.1f}% in the same batch shape")
    slug = Path(str(args.model)).name.replace("/", "_")
    write_result(result, args.out or RESULTS / f"generate-{slug}.json")


if __name__ == "__main__":
    main()
