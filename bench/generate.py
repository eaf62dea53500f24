"""Steered generation throughput on the embedded model: one batched generate call vs one prompt at a time.

Both arms generate the same prompts with the same per-prompt seeds and the same steering hook; tokens/s
counts generated tokens only. Prints a table and writes bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.prompts import load_prompts
from poolbench.steerer.run import prompt_seeds
from poolbench.steerer.worker import SteeringWorker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="transformers")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    worker = SteeringWorker(args.model, backend=args.backend)
    prompts = load_prompts(None, args.prompts)
    seeds = prompt_seeds(len(prompts), 0)
    rng = np.random.default_rng(0)
    direction = rng.normal(size=worker.loaded.hidden_size).astype(np.float32)
    delta = 0.25 * worker.residual_norm(prompts, args.layer) * direction / np.linalg.norm(direction)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, batch_size=len(prompts))
    worker.generate(prompts[:2], layer=args.layer, delta=delta, seeds=seeds[:2], settings=settings)  # warm-up

    def timed(fn):
        cpu, start = time.process_time(), time.perf_counter()
        gens = fn()
        return gens, time.perf_counter() - start, time.process_time() - cpu

    batched, t_batched, cpu_batched = timed(lambda: worker.generate(
        prompts, layer=args.layer, delta=delta, seeds=seeds, settings=settings))
    single, t_single, cpu_single = timed(lambda: [g for p, s in zip(prompts, seeds, strict=True) for g in
                                                  worker.generate([p], layer=args.layer, delta=delta, seeds=[s],
                                                                  settings=settings)])
    n_b = sum(len(g.token_ids) for g in batched)
    n_s = sum(len(g.token_ids) for g in single)
    same = sum(a.token_ids == b.token_ids for a, b in zip(batched, single, strict=True))
    result = {
        "model": args.model, "backend": args.backend, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "layer": args.layer, "threads": args.threads,
        "batched": {"seconds": t_batched, "cpu_seconds": cpu_batched, "tokens": n_b, "tokens_per_s": n_b / t_batched},
        "one_at_a_time": {"seconds": t_single, "cpu_seconds": cpu_single, "tokens": n_s,
                          "tokens_per_s": n_s / t_single},
        "speedup": (n_b / t_batched) / (n_s / t_single),
        "identical_continuations": f"{same}/{len(prompts)}",
        "load_average_1m": os.getloadavg()[0], "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "machine": platform.machine(),
    }
    print(f"{'mode':<16}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}")
    for name, key in (("batched", "batched"), ("one at a time", "one_at_a_time")):
        r = result[key]
        print(f"{name:<16}{r['tokens']:>8}{r['seconds']:>10.2f}{r['tokens_per_s']:>11.1f}")
    print(f"speedup {result['speedup']:.1f}x; identical continuations {result['identical_continuations']}; "
          f"load average {result['load_average_1m']:.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
