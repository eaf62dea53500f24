"""`reproduce`: run one model as a published profile ran it (`--profile poolbench-v1`), or `--check` a finished
run's mean D1 per strategy against the official leaderboard's numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from poolbench.errors import PoolBenchError

console = Console()


def reproduce(
    model_key: Annotated[str, typer.Option(help="llama3_8b, gemma2_9b or mistral_7b")],
    corpus: Annotated[str, typer.Option(
        help="the PoolBench-layout corpus folder (`huggingface-cli download ... --repo-type dataset --local-dir`)")]
    = "",
    profile: Annotated[str, typer.Option(help="the published run's settings")] = "poolbench-v1",
    model: Annotated[str | None, typer.Option(help="a local copy of the profile's model (default: its HF id)")]
    = None,
    out: Annotated[Path | None, typer.Option(help="run folder; default runs/reproduce-<model key>")] = None,
    store: Annotated[str | None, typer.Option(help="artifact store: a folder or s3://bucket/prefix")] = None,
    check: Annotated[bool, typer.Option(help="diff the run in --out against the official numbers; run nothing")]
    = False,
    tolerance: Annotated[float | None, typer.Option(help="largest |ours - official| mean D1 that passes")] = None,
) -> None:
    """Run a model as the official PoolBench v1 run did (its strategies, layers, max length 600, bf16, eager
    attention, protocol pb), or with --check compare a finished run to the official leaderboard."""
    from poolbench.driver.reproduce import CHECK_TOLERANCE, check_run, load_profile, profile_config

    settings, official = load_profile(profile)
    run_dir = out or Path("runs") / f"reproduce-{model_key}"
    if check:
        board_path = run_dir / "leaderboard.json"
        if not board_path.is_file():
            raise PoolBenchError(f"no leaderboard.json in {run_dir}: run `reproduce --model-key {model_key}` first")
        limit = CHECK_TOLERANCE if tolerance is None else tolerance
        rows = check_run(settings, official, model_key, json.loads(board_path.read_text()), limit)
        for r in rows:
            ours = "-" if r.ours is None else f"{r.ours:.4f}"
            theirs = "-" if r.official is None else f"{r.official:.4f}"
            diff = "" if r.difference is None else f"{r.difference:+.4f}"
            mark = {True: "ok", False: "OFF", None: "n/a"}[r.within]
            console.print(f"{r.reference_id:<22} {r.strategy:<18} official {theirs}  ours {ours}  {diff:>8}  {mark}",
                          highlight=False)
        off = [r.reference_id for r in rows if r.within is False]
        compared = sum(r.within is not None for r in rows)
        if off:
            raise PoolBenchError(f"{len(off)} of {compared} strategies differ from the official mean D1 by more "
                                 f"than {limit}: {', '.join(off)}")
        console.print(f"{compared} strategies within {limit} of the official mean D1", highlight=False)
        return
    if not corpus:
        raise PoolBenchError("--corpus: give the PoolBench-layout corpus folder (docs/reproduce.md says how)")
    from poolbench.api import evaluate_config

    cfg = profile_config(settings, model_key, corpus=corpus, out=str(run_dir), store=store, model=model)
    results = evaluate_config(cfg)
    console.print(f"wrote {results.paths['leaderboard']}; compare: poolbench-driver reproduce --check "
                  f"--model-key {model_key} --out {run_dir}", highlight=False, soft_wrap=True)
