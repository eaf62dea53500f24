"""The whole benchmark at scale: the driver's own run (pool, then D1 with reliability) on a random-weight model of a
published shape, beside the raw forward over the same tokens, and a projection to PoolBench's full size.

`--shape llama-3.1-8b --device cuda --concepts 2` runs `poolbench-driver run --model shape:llama-3.1-8b
--corpus-size full --max-length 512 --no-steering` in this process (poolbench.api.evaluate_config: Ray, the
extractor actor, the D1 tasks), into a fresh temporary store, so nothing is read back. Per concept: the extractor's
pooling seconds and the D1 seconds from its probes' start to its last layer gathered; first, the raw forward (the
plain decoder, no hooks, inference_mode: forward_baselines.forward_only) timed here on the same passages in the
run's padded batches, its model freed before the run starts. SIGINT stops the run and writes what it measured
("complete": false). The extractor actor reports its forwards, rows per forward and peak memory
(torch.cuda.max_memory_allocated on a GPU, its RSS on CPU) through Ray's `__ray_call__` (bench instrumentation
only: nothing in the run changes). The projection to 17 concepts x 2,000 passages x 400 tokens multiplies the
measured per-token rates (pooling, raw forward) and the per-passage D1 rate by that size: a projection, not a
measurement; with two or more concepts `total_after_the_first` projects from the concepts pooled after the first
(the one-off start paid once, D1 beside the forwards where the driver runs it so), and the total's target is judged
on it (`met_total_from`). Writes bench/results/scale.json (--out).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from bench_io import RESULTS, run_header, write_result
from device_facts import device_name, peak_bytes
from rich.console import Console
from scale_counters import INTERRUPTED, capture_by_concept, counted_extractors

from poolbench.api import evaluate_config, run_config
from poolbench.corpus.source import limit_passages, open_corpus
from poolbench.driver.pipeline import default_layers
from poolbench.driver.probe_gate import probes_beside
from poolbench.extractor.capture import resolve_max_batch_tokens
from poolbench.extractor.forward_baselines import forward_only
from poolbench.extractor.loading import load_model
from poolbench.extractor.model_shapes import SHAPE_PREFIX, SHAPES
from poolbench.extractor.padded_batches import prepare_batches
from poolbench.records.events import ConceptPooled, ConceptProbed, LayerProbed, RunPlanned

FULL_CONCEPTS, FULL_PASSAGES, FULL_TOKENS = 17, 2000, 400  # PoolBench's own benchmark: 13.6 M tokens
# What met["d1_17_concepts_s_max"] is judged on, which is not what bench/d1_cost.py times (the cells alone, N
# processes at once): the driver's D1 where it runs alone, start-ups, table reads and waits for a slot included.
D1_MET_FROM = ("the driver's D1 where nothing else runs, scaled by passages to 17 x 2,000 (d1_alone): the last "
               "concept's D1 (from the end of the pooling) where the probes run beside the pooling, every concept's "
               "D1 from the last pooling where they wait; probe processes' starts, table reads and waits included. "
               "Not the D1 wall clock from the first concept pooled (d1_wall_17_s), which beside the pooling holds "
               "the later concepts' pooling; bench/d1_cost.py times the cells alone")
TARGETS = {"pooling_over_raw_tokens_per_s_min": 1 / 3, "d1_17_concepts_s_max": 300.0, "total_s_max": 1800.0}


@dataclass(frozen=True)
class Projection:
    """The full benchmark's seconds from the run's mean rates: pooling and the raw forward per token, D1 per passage
    (its fits grow with the passages, not their length). An upper bound: the first concept's one-off start is
    scaled with its tokens, and `total_s` runs all of D1 after the pooling (a GPU probes beside it);
    total_after_the_first is the warm model."""

    concepts: int
    passages_per_concept: int
    tokens_per_passage: int
    tokens: int
    passages: int
    raw_forward_s: float
    pooling_s: float
    d1_s: float
    total_s: float
    note: str = "a projection from this run's per-token and per-passage rates, not a measurement"


def project(tokens: int, passages: int, raw_s: float, pooling_s: float, d1_s: float, *,
            concepts: int = FULL_CONCEPTS, per_concept: int = FULL_PASSAGES,
            per_passage: int = FULL_TOKENS) -> Projection:
    """Measured seconds over `tokens` tokens (`passages` passages) scaled to concepts x per_concept x per_passage."""
    full_tokens, full_passages = concepts * per_concept * per_passage, concepts * per_concept
    pooling = pooling_s * full_tokens / tokens
    d1 = d1_s * full_passages / passages
    return Projection(concepts, per_concept, per_passage, full_tokens, full_passages,
                      raw_forward_s=raw_s * full_tokens / tokens, pooling_s=pooling, d1_s=d1, total_s=pooling + d1)


def after_the_first(rows: list[dict]) -> dict | None:
    """Pooling over the concepts pooled after the first, beside the raw forward over the same tokens: the first
    concept's pooling holds the extractor's one-off costs (CUDA context, cuBLAS handles, kernels' first launches)
    that a 17-concept run pays once; None with one concept. The projection from these rates keeps the first
    concept's measured seconds as they were and scales the warm rate to the other concepts."""
    pooled = sorted(rows, key=lambda r: r["pooled_at_s"])
    if len(pooled) < 2:
        return None
    first, rest = pooled[0], pooled[1:]
    tokens = sum(r["tokens"] for r in rest)
    pool_s, raw_s = sum(r["pool_s"] for r in rest), sum(r["raw_s"] for r in rest)
    full_tokens = FULL_CONCEPTS * FULL_PASSAGES * FULL_TOKENS
    projected = first["pool_s"] + pool_s / tokens * max(0, full_tokens - first["tokens"])
    return {"concepts": [r["concept"] for r in rest], "tokens": tokens, "pool_s": pool_s, "raw_s": raw_s,
            "pool_s_beside_d1": sum(r.get("pooling_beside_d1_s", 0.0) for r in rest),
            "tokens_per_s": tokens / pool_s, "tokens_per_s_over_raw": raw_s / pool_s,
            "projected_pooling_s": projected,
            "met_pooling_over_raw": raw_s / pool_s >= TARGETS["pooling_over_raw_tokens_per_s_min"]}


def total_after_the_first(rows: list[dict], warm: dict | None, d1_beside: bool, serial_d1_s: float,
                          after_d1_s: float) -> dict | None:
    """The full benchmark's wall clock on the warm model: the pooling as after_the_first projects it (the first
    concept's one-off start paid once), then the D1 that is left when the last concept is pooled, then what the run
    computes after its last D1 result (`after_d1_s`, already scaled to the full size: baselines, breakdowns, the
    answer's bootstraps and the documents, on the host).

    On a GPU a concept's probes run beside the next concept's forwards (driver/probe_gate.py), so only the last
    concept's D1 adds to the pooling, as long as every concept's D1, scaled to a full concept's passages, takes no
    longer than a full concept's warm pooling (`d1_keeps_pace`); otherwise, and where D1 waits for the pooling (a
    CPU), the whole D1 projection (`serial_d1_s`) is added. D1 scales per passage, as in `project`: its fits grow
    faster than that with n, and its fixed costs (process and CUDA starts, reading the tables) slower. None with
    one concept."""
    if warm is None:
        return None
    per_full_concept = FULL_PASSAGES * FULL_TOKENS / warm["tokens_per_s"]
    scaled = [(r["probed_at_s"] - r["pooled_at_s"]) * FULL_PASSAGES / r["passages"] for r in rows]
    last = max(range(len(rows)), key=lambda i: rows[i]["pooled_at_s"])
    keeps_pace = d1_beside and max(scaled) <= per_full_concept
    d1_after = scaled[last] if keeps_pace else serial_d1_s
    return {"pooling_s": warm["projected_pooling_s"], "full_concept_pooling_s": per_full_concept,
            "d1_per_full_concept_s": max(scaled), "d1_keeps_pace": keeps_pace, "d1_after_pooling_s": d1_after,
            "after_d1_s": after_d1_s, "total_s": warm["projected_pooling_s"] + d1_after + after_d1_s,
            "note": "a projection from the concepts pooled after the first, not a measurement"}


def d1_alone(rows: list[dict], d1_beside: bool, d1_s: float) -> dict:
    """The driver's D1 over a stretch where nothing else runs, scaled per passage to 17 x 2,000 passages: where the
    probes wait for the pooling (a CPU, --probes-per-gpu 0), every concept's D1 from the last pooling (d1_s); where
    they run beside it (a GPU), the last concept's, which starts when the pooling ends (its layer tasks beside any
    earlier concept's still running: a backlog counts). Beside the pooling the D1 wall clock from the first concept
    pooled holds the later concepts' pooling, so at 17 concepts it would be the pooling's ~25 minutes whatever
    D1's speed; a concept alone has six layer tasks, fewer than the eight probe slots a GPU gives them after the
    pooling, so scaling one concept by 17 leaves slots idle that a full run fills: an upper bound on that count."""
    if d1_beside:
        last = max(rows, key=lambda r: r["pooled_at_s"])
        seconds, measured, passages = last["probed_at_s"] - last["pooled_at_s"], [last["concept"]], last["passages"]
        source = "the last concept's D1, from the end of the pooling"
    else:
        seconds, measured = d1_s, [r["concept"] for r in rows]
        passages, source = sum(r["passages"] for r in rows), "every concept's D1, from the last pooling"
    return {"seconds": seconds, "concepts": measured, "passages": passages, "from": source,
            "projected_17_concepts_s": seconds * FULL_CONCEPTS * FULL_PASSAGES / passages,
            "note": "scaled per passage from this run's passages, not measured at 17 x 2,000"}


def beside_d1_seconds(rows: list[dict], d1_beside: bool) -> list[float]:
    """Per concept, the seconds of its pooling during which another concept's D1 probes ran: on a GPU those share the
    device with the forward (driver/probe_gate.py), so a pooling rate read beside them is the driver's rate with its
    probes, not the extractor's alone. From the events' times: a concept pooled over [pooled_at - pool_s, pooled_at],
    its D1 from its pooling's end (beside) or from the last pooling's end (waiting) to probed_at."""
    gate = max(r["pooled_at_s"] for r in rows)
    probes = [(r["pooled_at_s"] if d1_beside else gate, r["probed_at_s"]) for r in rows]
    out = []
    for i, row in enumerate(rows):
        start, end = row["pooled_at_s"] - row["pool_s"], row["pooled_at_s"]
        others = sorted((max(a, start), min(b, end)) for j, (a, b) in enumerate(probes) if j != i)
        covered, reached = 0.0, start
        for a, b in others:
            a = max(a, reached)
            if b > a:
                covered, reached = covered + b - a, b
        out.append(covered)
    return out


def concept_names(spec: str, corpus_size: str) -> list[str]:
    """`--concepts 2`: the corpus's first two; `--concepts hedging,toxicity`: those."""
    if spec.isdigit():
        return list(open_corpus("embedded", corpus_size).concepts[: int(spec)])
    return [c for c in spec.split(",") if c]


class Interrupted(BaseException):
    """SIGINT (`timeout -s INT` in bench/gpu_measure.sh): stop the run, keep what was measured; a BaseException
    like KeyboardInterrupt, so no `except Exception` on the way swallows it."""




def on_sigint(_signum: int, _frame: object) -> None:
    INTERRUPTED.append(True)
    raise Interrupted


def driver_run(args: argparse.Namespace, concepts: list[str], work: Path, per_concept: dict[str, dict],
               run: dict, counts: list[dict], on_gpu: bool) -> None:
    """The driver's run, filling `per_concept` (pooling seconds, when pooled and probed, seconds from the start)
    and `run` as its events come, so an interrupted run leaves what it measured."""
    cfg = run_config(model=SHAPE_PREFIX + args.shape, dtype=args.dtype, device=args.device,
                     corpus_size=args.corpus_size, concepts=concepts, max_length=args.max_length, limit=args.limit,
                     batch_size=args.batch_size, n_bootstrap=args.n_bootstrap, steering=False, reliability=True,
                     store=str(work / "store"), out=str(work / "run"), drop_pooled=args.drop_pooled,
                     **({"layers": [int(v) for v in args.layers.split(",")]} if args.layers else {}),
                     **({"strategies": args.strategies.split(",")} if args.strategies else {}))
    start = time.perf_counter()

    def on_event(event: object) -> None:
        now = time.perf_counter() - start
        if args.drop_pooled and isinstance(event, ConceptPooled | ConceptProbed):  # the vectors in the store at most
            run["peak_pooled_bytes"] = max(run.get("peak_pooled_bytes", 0), pooled_bytes(work / "store"))
        if isinstance(event, RunPlanned):
            run.update(layers=list(event.layers), strategies=list(event.strategies), n_layers=event.n_layers,
                       hidden_size=event.hidden_size, planned_at_s=now)
        elif isinstance(event, ConceptPooled):
            per_concept[event.concept].update(pool_s=event.seconds, pooled_at_s=now)
            print(f"[{now:7.1f} s] pooled {event.concept} in {event.seconds:.1f} s", flush=True)
        elif isinstance(event, LayerProbed):  # one layer's D1 task: where its seconds went, when it came back
            per_concept[event.concept].setdefault("d1_layers", []).append(
                {"layer": event.layer, "cells": event.cells, "read_s": event.read_s, "probe_s": event.probe_s,
                 "write_s": event.write_s, "wall_s": event.wall_s, "pid": event.pid,
                 "earlier_tasks": event.earlier_tasks, "devices": event.devices, "done_at_s": now})
        elif isinstance(event, ConceptProbed):
            per_concept[event.concept]["probed_at_s"] = now
            print(f"[{now:7.1f} s] probed {event.concept} (D1 with reliability)", flush=True)

    with counted_extractors(lambda: (run["layers"], run["strategies"], args.max_length), counts):
        results = evaluate_config(cfg, on_event=on_event)
    returned = time.perf_counter() - start
    run["store_bytes"] = store_bytes_by_kind(work / "store")
    # The driver's own rule (driver/probe_gate.py): on CPU the probes wait for the last pooling, on a GPU a
    # concept's probes start beside the next concept's forwards (unless --probes-per-gpu 0).
    beside = probes_beside(cfg, on_gpu)
    gate = max(c["pooled_at_s"] for c in per_concept.values())
    for c in per_concept.values():
        c["d1_s"] = c["probed_at_s"] - (c["pooled_at_s"] if beside else gate)
    rows = list(per_concept.values())
    for c, seconds in zip(rows, beside_d1_seconds(rows, beside), strict=True):
        c["pooling_beside_d1_s"] = seconds
    timing = results.document.get("timing") or {}
    d1_start = min(c["pooled_at_s"] for c in per_concept.values()) if beside else gate
    last_probed = max(c["probed_at_s"] for c in per_concept.values())
    run.update(pooling_s=sum(c["pool_s"] for c in per_concept.values()), d1_s=last_probed - d1_start,
               total_s=float(timing.get("total_s", time.perf_counter() - start)), d1_waits_for_pooling=not beside,
               # the run's stages after its last D1 result (gathering, baselines, breakdowns, the results documents
               # and the answer), which no projection here scales: measured whole at this run's corpus
               after_d1_s=returned - last_probed,
               d1_records=len(results.cells), cells=len({(c.concept, c.layer, c.strategy) for c in results.cells}))


POOLED_KINDS = ("pooled", "iti_heads", "gradient_sums", "learned_folds")  # what a concept's pooling stores


def store_bytes_by_kind(root: Path) -> dict[str, int]:
    """The run's store on disk, bytes per artifact kind (a key's first part is its folder), sidecars included."""
    sizes: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.is_file():
            kind = path.relative_to(root).parts[0]
            sizes[kind] = sizes.get(kind, 0) + path.stat().st_size
    return dict(sorted(sizes.items()))


def pooled_bytes(root: Path) -> int:
    return sum(n for kind, n in store_bytes_by_kind(root).items() if kind in POOLED_KINDS)


def store_projection(by_kind: dict[str, int], passages: int, peak_pooled: int | None = None) -> dict:
    """The pooled artifacts' bytes a passage (at the run's layers), and at the full benchmark's 17 x 2,000; with
    --drop-pooled (`peak_pooled`: the most found in the store as each concept was pooled or probed) none is left at
    the end to count, so none is projected."""
    if peak_pooled is not None:
        return {"bytes_by_kind": by_kind, "drop_pooled": True, "peak_pooled_bytes": peak_pooled,
                "note": "--drop-pooled: each concept's vectors left the store once its D1 was stored; the peak is "
                        "read as each concept was pooled or probed"}
    pooled = sum(n for kind, n in by_kind.items() if kind in POOLED_KINDS)
    per_passage = pooled / passages
    return {"bytes_by_kind": by_kind, "pooled_bytes": pooled, "pooled_bytes_per_passage": per_passage,
            "projected_pooled_gb": per_passage * FULL_CONCEPTS * FULL_PASSAGES / 1e9,
            "note": "the run's layers and strategies at its --store-dtype (float32); measured on disk"}


def raw_forward(args: argparse.Namespace, concepts: list[str], per_concept: dict[str, dict]) -> dict:
    """The plain forward over each concept's passages in the run's padded batches, best of --repeats, in this
    process before the run (the model is freed after it, so the run's extractor has the device to itself)."""
    loaded = load_model(SHAPE_PREFIX + args.shape, dtype=args.dtype, device=args.device)
    corpus = open_corpus("embedded", args.corpus_size, concepts)
    layers = [int(v) for v in args.layers.split(",")] if args.layers else default_layers(loaded.n_layers)
    budget = resolve_max_batch_tokens(loaded.model, layers, None)  # the budget the run's pooling cuts buckets at
    batches = {c: prepare_batches(loaded.tokenizer, limit_passages(corpus.passages(c), args.limit),
                                  batch_size=args.batch_size, max_length=args.max_length, max_tokens=budget)
               for c in concepts}
    forward_only(loaded.model, batches[concepts[0]][:1])  # warm-up: allocator, kernels
    if loaded.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(loaded.device)
    for c, bs in batches.items():
        per_concept[c].update(passages=sum(len(b.indices) for b in bs),
                              tokens=sum(int(b.attention_mask.sum()) for b in bs),
                              padded_tokens=sum(int(b.attention_mask.size) for b in bs),
                              raw_s=min(forward_only(loaded.model, bs).forward_seconds for _ in range(args.repeats)))
    raw = {"peak_bytes": peak_bytes(loaded.device), "device": str(loaded.device),
           "device_name": device_name(loaded.device), "dtype": str(loaded.dtype),
           "weights_hash": loaded.weights_hash}
    del loaded, batches
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return raw


def measure(args: argparse.Namespace) -> dict:
    concepts = concept_names(args.concepts, args.corpus_size)
    started = time.perf_counter()
    per_concept: dict[str, dict] = {c: {"concept": c} for c in concepts}
    raw = raw_forward(args, concepts, per_concept)
    rows = list(per_concept.values())
    tokens, passages = sum(r["tokens"] for r in rows), sum(r["passages"] for r in rows)
    raw_s = sum(r["raw_s"] for r in rows)
    print(f"raw forward: {tokens:,} tokens in {raw_s:.2f} s ({tokens / raw_s:,.0f} tok/s)", flush=True)
    run: dict = {}
    counts: list[dict] = []
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with tempfile.TemporaryDirectory(prefix="poolbench-scale-") as tmp:
            driver_run(args, concepts, Path(tmp), per_concept, run, counts, raw["device"].startswith("cuda"))
    except Interrupted:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)
    header = run_header("scale", args, raw["device"])
    result = {
        **header, "device": raw["device_name"], "git": header["git_hash"], "shape": args.shape,
        "model": SHAPE_PREFIX + args.shape, "weights_hash": raw["weights_hash"], "dtype": raw["dtype"],
        "torch": torch.__version__, "cuda": torch.version.cuda, "complete": "cells" in run,
        "config": {"concepts": concepts, "corpus_size": args.corpus_size, "max_length": args.max_length,
                   "limit": args.limit, "batch_size": args.batch_size, "n_bootstrap": args.n_bootstrap,
                   "reliability": True, "steering": False, "drop_pooled": args.drop_pooled, "layers": run.get("layers"),
                   "strategies": run.get("strategies"), "n_layers": run.get("n_layers"),
                   "hidden_size": run.get("hidden_size"), "cells": run.get("cells"),
                   "d1_records": run.get("d1_records")},
        "tokens": tokens, "padded_tokens": sum(r["padded_tokens"] for r in rows), "passages": passages,
        "per_concept": rows,
        "raw_forward": {"seconds": raw_s, "tokens_per_s": tokens / raw_s, "repeats": args.repeats},
        "peak_bytes": {"raw_forward": raw["peak_bytes"],
                       "kind": "cuda_max_allocated" if raw["device"].startswith("cuda") else "rss",
                       "note": "the extractor actor's and this process's; the D1 tasks' own processes are not read"},
        "targets": TARGETS,
    }
    if not result["complete"]:
        result["note"] = "interrupted: per_concept holds what was pooled and probed before the signal"
        return result
    counted = [c for c in counts if "error" not in c]
    jobs = capture_by_concept(counted, {row["concept"]: row["raw_s"] for row in rows})
    for row in rows:  # each concept's pooling job(s) from inside the extractor: its capture against its raw forward
        row["capture"] = jobs.get(row["concept"], [])
    forwards = sum(c["forwards"] for c in counted)
    pooling = {"tokens_per_s": tokens / run["pooling_s"], "over_raw": run["pooling_s"] / raw_s,
               "tokens_per_s_over_raw": raw_s / run["pooling_s"], "forwards": forwards,
               "rows_per_forward": sum(c["passages"] for c in counted) / forwards if forwards else None,
               "forward_padded_tokens": sum(c["padded_tokens"] for c in counted),
               "planned_rows_per_forward": [c["planned_rows_per_forward"] for c in counted],
               "extractors": counts}
    projection = project(tokens, passages, raw_s, run["pooling_s"], run["d1_s"])
    warm = after_the_first(rows)
    # The stage after D1 grows with the passages (its bootstraps resample them; strategies are the run's own), not
    # with the tokens: scaled per passage, as D1 is.
    after_d1_full_s = run["after_d1_s"] * projection.passages / passages
    warm_total = total_after_the_first(rows, warm, not run["d1_waits_for_pooling"], projection.d1_s,
                                       after_d1_full_s)
    alone = d1_alone(rows, not run["d1_waits_for_pooling"], run["d1_s"])
    total = warm_total["total_s"] if warm_total else projection.total_s
    result["peak_bytes"]["extractor"] = max((c["peak_bytes"] for c in counted), default=None)
    return {
        **result,
        "seconds": {"pooling": run["pooling_s"], "d1": run["d1_s"], "total": run["total_s"], "raw_forward": raw_s,
                    "after_d1": run["after_d1_s"],
                    "bench_wall": time.perf_counter() - started},
        "d1_waits_for_pooling": run["d1_waits_for_pooling"], "d1_alone": alone,
        # sessions 30-36 judged D1 on this: the wall clock from the first concept pooled, scaled per passage
        "d1_wall_17_s": projection.d1_s,
        "pooling": pooling, "projection": asdict(projection),
        "after_the_first": warm, "total_after_the_first": warm_total,
        "store": store_projection(run["store_bytes"], passages, run.get("peak_pooled_bytes", 0)
                                  if args.drop_pooled else None),
        "met": {"pooling_over_raw_tokens_per_s_min": pooling["tokens_per_s_over_raw"] >= TARGETS[
                    "pooling_over_raw_tokens_per_s_min"],
                "d1_17_concepts_s_max": alone["projected_17_concepts_s"] <= TARGETS["d1_17_concepts_s_max"],
                "total_s_max": total <= TARGETS["total_s_max"]},
        "met_total_from": "total_after_the_first" if warm_total else "projection",
        "met_d1_from": D1_MET_FROM,
    }


def report(result: dict) -> None:
    console = Console()
    if not result["complete"]:
        console.print(f"{result['model']} on {result['device']}: {result['note']}")
        return
    s, p = result["seconds"], result["projection"]
    console.print(f"{result['model']} on {result['device']}: {result['tokens']:,} tokens "
                  f"({result['padded_tokens']:,} padded), {result['passages']} passages, "
                  f"{len(result['config']['concepts'])} concept(s)")
    for row in result["per_concept"]:
        console.print(f"  {row['concept']}: pooling {row['pool_s']:.1f} s ({row['pooling_beside_d1_s']:.1f} s of it "
                      f"beside another concept's D1), D1 {row['d1_s']:.1f} s, raw forward {row['raw_s']:.2f} s over "
                      f"{row['tokens']:,} tokens")
        for job in row.get("capture", []):
            shared = f" (a job of {', '.join(job['concepts'])})" if len(job["concepts"]) > 1 else ""
            ratio = f", {job['forward_over_raw']:.2f}x the raw forward" if job["forward_over_raw"] else ""
            spread = (f" (first {job['first_forward_s']:.2f} s, median {job['median_forward_s']:.2f} s, slowest "
                      f"{job['slowest_forward_s']:.2f} s)" if job.get("first_forward_s") is not None else "")
            console.print(f"    capture{shared}: forwards {job['forward_s']:.1f} s{ratio}{spread}, host pooling "
                          f"{job['pool_s']:.1f} s, preparation {job['prepare_s']:.1f} s, job {job['wall_s']:.1f} s")
        tasks = row.get("d1_layers", [])
        if tasks:
            total = {name: sum(t[name] for t in tasks) for name in ("cells", "read_s", "probe_s", "write_s", "wall_s")}
            console.print(f"    D1 tasks: {len(tasks)} layers, {total['cells']} records; summed over them reading "
                          f"{total['read_s']:.1f} s, fitting {total['probe_s']:.1f} s, writing "
                          f"{total['write_s']:.1f} s, from submission to result {total['wall_s']:.1f} s; "
                          f"{len({t['pid'] for t in tasks})} "
                          f"processes, {sum(t['earlier_tasks'] == 0 for t in tasks)} tasks first in theirs")
    console.print(f"pooling {s['pooling']:.1f} s ({result['pooling']['tokens_per_s']:,.0f} tok/s, "
                  f"{result['pooling']['over_raw']:.2f}x raw), D1 {s['d1']:.1f} s, after the last D1 result "
                  f"{s['after_d1']:.1f} s, run total {s['total']:.1f} s; "
                  f"raw forward {s['raw_forward']:.2f} s ({result['raw_forward']['tokens_per_s']:,.0f} tok/s)")
    warm = result.get("after_the_first")
    if warm:
        console.print(f"after the first concept: pooling {warm['pool_s']:.1f} s over {warm['tokens']:,} tokens "
                      f"({warm['tokens_per_s']:,.0f} tok/s, {warm['tokens_per_s_over_raw']:.2f} of the raw "
                      f"forward's rate; {warm['pool_s_beside_d1']:.1f} s of it beside D1 probes); projected "
                      f"pooling {warm['projected_pooling_s'] / 60:.1f} min")
    console.print(f"projection ({p['note']}) to {p['concepts']} x {p['passages_per_concept']} passages x "
                  f"{p['tokens_per_passage']} tokens: raw forward {p['raw_forward_s'] / 60:.1f} min, pooling "
                  f"{p['pooling_s'] / 60:.1f} min, D1 {p['d1_s'] / 60:.1f} min, total {p['total_s'] / 60:.1f} min")
    alone = result["d1_alone"]
    console.print(f"D1 alone: {alone['seconds']:.1f} s for {alone['passages']:,} passages ({alone['from']}), "
                  f"{alone['projected_17_concepts_s'] / 60:.1f} min scaled to {p['concepts']} x "
                  f"{p['passages_per_concept']} (target {TARGETS['d1_17_concepts_s_max'] / 60:.0f}); the wall clock "
                  f"from the first concept pooled, scaled: {result['d1_wall_17_s'] / 60:.1f} min")
    outlook = result.get("total_after_the_first")
    if outlook:
        console.print(f"projection from the concepts after the first ({outlook['note']}): pooling "
                      f"{outlook['pooling_s'] / 60:.1f} min, then D1 {outlook['d1_after_pooling_s'] / 60:.1f} min "
                      f"({'the last concept' if outlook['d1_keeps_pace'] else 'all of it'}), then "
                      f"{outlook['after_d1_s'] / 60:.1f} min after D1, total {outlook['total_s'] / 60:.1f} min")
    store = result["store"]
    if store.get("drop_pooled"):
        console.print(f"store: pooled artifacts at most {store['peak_pooled_bytes'] / 1e9:.2f} GB at once "
                      "(--drop-pooled)")
    else:
        console.print(f"store: pooled artifacts {store['pooled_bytes'] / 1e9:.2f} GB "
                      f"({store['pooled_bytes_per_passage'] / 1e6:.2f} MB a passage), projected "
                      f"{store['projected_pooled_gb']:.1f} GB for {p['concepts']} x {p['passages_per_concept']} "
                      "passages")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--concepts", default="2", help="how many of the corpus's concepts (first N), or names")
    parser.add_argument("--corpus-size", default="full", choices=("tiny", "small", "full"))
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--limit", type=int, default=None, help="at most N passages per class and split (run's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-bootstrap", type=int, default=1000)
    parser.add_argument("--layers", default=None, help="comma list (default: the run's, six for a deep model)")
    parser.add_argument("--strategies", default=None, help="comma list (default: all 19 of the card)")
    parser.add_argument("--repeats", type=int, default=1, help="raw forward: best of N")
    parser.add_argument("--probes-per-gpu", type=int, default=None,
                        help="D1 probe tasks beside one extractor ($POOLBENCH_PROBES_PER_GPU; default the run's 2; "
                        "0: the probes wait for the pooling, then 8 share the GPU)")
    parser.add_argument("--drop-pooled", action="store_true",
                        help="the run's --drop-pooled: each concept's vectors leave the store once its D1 is stored "
                        "(a full corpus that outgrows the disk: 17 concepts of an 8B model are ~177 GB at float32)")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    args = parser.parse_args(argv)
    if args.probes_per_gpu is not None:
        from poolbench.driver.extractor_fleet import PROBES_PER_GPU_ENV
        os.environ[PROBES_PER_GPU_ENV] = str(args.probes_per_gpu)
    result = measure(args)
    report(result)
    write_result(result, args.out)
    if not result["complete"]:  # interrupted: Ray's own shutdown may hang on processes the signal reached too
        sys.stdout.flush()
        os._exit(130)


if __name__ == "__main__":
    main()
