"""`power` and `flash-check`: thin CLI shells over poolbench.prober.power / flash, reading a finished run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from poolbench.atomic_write import write_json_atomic
from poolbench.cli.options import DEFAULT_RUN, out_folder
from poolbench.errors import PoolBenchError

reliability_app = typer.Typer(no_args_is_help=True, help="Reliability: statistical power and flash subsets.")
console = Console()
DEFAULT_FRACTIONS = "1/2,1/4,1/8,1/16,1/32,1/64"


def _load_results(run_dir: Path) -> dict:
    path = run_dir / "results.json"
    if not path.is_file():
        raise PoolBenchError(f"no results.json in {run_dir}")
    return json.loads(path.read_text())


def _store(results: dict):
    from poolbench.store.url import open_run_store

    return open_run_store(results)


def _resolve_strategy(name: str, known: list[str]) -> str:
    """An exact id, or a short code such as A1 for A1_mean."""
    if name in known:
        return name
    matches = [s for s in known if s.split("_", 1)[0] == name]
    if len(matches) != 1:
        raise PoolBenchError(f"strategy '{name}' was not run (ran: {', '.join(known)})")
    return matches[0]


def _best_layers(results: dict) -> dict[str, int]:
    from poolbench.records.d1 import D1CellRecord
    from poolbench.results.answer.leaderboard import build_leaderboard

    cells = [D1CellRecord.from_dict(c) for c in results["cells"]]
    return {row["strategy"]: row["best_layer"] for row in build_leaderboard(cells)["strategies"]}


def _pooled(results: dict, store, concept: str):
    """The concept's stored PooledTable (and ITIHeadTable, for S3), named by the run's results.json."""
    from poolbench.pooler.iti import needs_head_table, read_head_table
    from poolbench.pooler.pooled_table import read_pooled_table
    from poolbench.prober.power import ConceptCells

    artifacts = results.get("artifacts", {})
    if concept not in artifacts:
        raise PoolBenchError(f"concept '{concept}' was not run (ran: {', '.join(sorted(artifacts))})")
    key = artifacts[concept]["pooled"]
    if key is None:
        raise PoolBenchError(f"concept '{concept}': the run dropped its pooled vectors once its D1 was stored "
                             "(--drop-pooled); run it again with --keep-pooled for the reliability commands")
    table = read_pooled_table(store, key)
    heads = read_head_table(store, key) if needs_head_table(table) else None
    return ConceptCells(table, heads, concept=concept, seed=int(results.get("seed", 0)))


@reliability_app.command("power")
def power(
    strategies: Annotated[list[str], typer.Option("--strategies", help="two, e.g. A1_mean P1_last")],
    concept: Annotated[str, typer.Option(help="the concept to compare on")],
    layer: Annotated[int | None, typer.Option(help="default: each one's leaderboard layer")] = None,
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
    n_bootstrap: Annotated[int, typer.Option(help="simulated test sets per size (bootstrap resamples)")] = 1000,
    seed: Annotated[int, typer.Option(help="seed for resampling")] = 0,
    out: Annotated[Path | None, typer.Option(help="folder for power_*.json; default the run folder")] = None,
) -> None:
    """McNemar, paired AUROC tests, simulated power and a recommended train size: A vs B on one concept."""
    from poolbench.prober.power import compare_strategies

    names = [v.strip() for s in strategies for v in s.split(",") if v.strip()]
    if len(names) != 2:
        raise PoolBenchError(f"--strategies needs exactly two strategies, got {len(names)}: {names}")
    results = _load_results(run_dir)
    known = [s["id"] for s in results["strategies"]]
    a, b = (_resolve_strategy(n, known) for n in names)
    if a == b:
        raise PoolBenchError(f"--strategies compares '{a}' with itself; name two different strategies")
    layers = {a: layer, b: layer} if layer is not None else _best_layers(results)
    report = compare_strategies(_pooled(results, _store(results), concept), a, layers[a], b, layers[b],
                                n_resamples=n_bootstrap, seed=seed)
    table = Table(title=f"{concept}: {a} (layer {layers[a]}) vs {b} (layer {layers[b]}), McNemar power")
    table.add_column("n test", justify="right")
    table.add_column("power", justify="right")
    for row in report["power"]:
        table.add_row(str(row["n"]), f"{row['power']:.3f}")
    console.print(table)
    rec = report["recommended_test_size"]
    rec_text = (f"{rec['n']}" if rec["n"] is not None
                else f"more than {rec['more_than']} (the largest size tried)")
    console.print(
        f"accuracy {report['accuracy_a']:.3f} vs {report['accuracy_b']:.3f}; McNemar p = "
        f"{report['mcnemar']['p_value']:.3g} (pairs: {report['mcnemar_pairs_p_value']:.3g}); "
        f"AUROC diff {report['auroc_difference']:+.3f} "
        f"[{report['paired_bootstrap']['ci_low']:+.3f}, {report['paired_bootstrap']['ci_high']:+.3f}], "
        f"DeLong p = {report['delong']['p_value']:.3g}; test passages for {rec['target_power']:.0%} power: "
        f"{rec_text}"
        f"{'; COLLAPSED: no difference beyond noise' if report['collapsed'] else ''}")
    target = (out_folder(out) if out is not None else run_dir) / f"power_{concept}_{a}_vs_{b}.json"
    write_json_atomic(target, report)
    console.print(f"wrote {target}")


def default_fractions(fractions: list, results: dict) -> tuple[list, list]:
    """(kept, dropped): a fraction f is kept when f x n_train / 2 >= 1/2 for the smallest concept, so the flash
    subset keeps at least one pair (or one passage per class) wherever it rounds."""
    sizes = [c["n_train"] for c in results.get("cells", []) if c.get("n_train")]
    if not sizes:
        return fractions, []
    smallest = min(sizes)
    kept = [f for f in fractions if f * smallest >= 1]
    return kept, [f for f in fractions if f not in kept]


@reliability_app.command("flash-check")
def flash_check(
    run_dir: Annotated[Path, typer.Option("--run", help="a finished run's --out folder")] = DEFAULT_RUN,
    fractions: Annotated[str | None, typer.Option(
        help=f"comma list of train fractions [default: {DEFAULT_FRACTIONS}, less those leaving no pair]")] = None,
    n_bootstrap: Annotated[int, typer.Option(help="bootstrap resamples of concepts")] = 1000,
    seed: Annotated[int, typer.Option(help="seed for subsets and bootstrap")] = 0,
    out: Annotated[Path | None, typer.Option(help="folder for flash_check.json; default the run folder")] = None,
) -> None:
    """Rank resolution and Kendall tau of flash (train-fraction) rankings against the full ranking."""
    from poolbench.prober.flash import parse_fraction
    from poolbench.prober.flash_check import flash_check as check

    results = _load_results(run_dir)
    parsed = [parse_fraction(f) for f in (fractions or DEFAULT_FRACTIONS).split(",") if f.strip()]
    if fractions is None:
        parsed, dropped = default_fractions(parsed, results)
        if dropped:
            console.print(f"skipped fractions {', '.join(map(str, dropped))}: they leave no train pair of the "
                          "smallest concept", highlight=False)
    if not parsed:
        raise PoolBenchError("--fractions is empty; give e.g. 1/2,1/4")
    strategies = sorted(s["id"] for s in results["strategies"])
    if len(strategies) < 2:
        raise PoolBenchError(f"flash-check needs >= 2 strategies in {run_dir}, found {len(strategies)}")
    store = _store(results)
    report = check((_pooled(results, store, c) for c in sorted(results["artifacts"])), strategies, parsed,
                   layers=_best_layers(results), n_bootstrap=n_bootstrap, seed=seed)
    table = Table(title="Flash vs full ranking (test AUROC, logistic probe, concepts as units, each strategy "
                        "at its leaderboard layer)")
    for column in ("fraction", "rank resolution", "Kendall tau", "worst strategy interval"):
        table.add_column(column, justify="left" if column == "worst strategy interval" else "right")
    for row in report["fractions"]:
        intervals = row["rank_difference_interval"]
        worst = max(strategies, key=lambda name: max(abs(intervals[name][0]), abs(intervals[name][1])))
        low, high = intervals[worst]
        table.add_row(row["fraction"], f"{row['rank_resolution']:.1f}", f"{row['kendall_tau']:.3f}",
                      f"{worst} [{low:+.1f}, {high:+.1f}]")
    console.print(table)
    target = (out_folder(out) if out is not None else run_dir) / "flash_check.json"
    write_json_atomic(target, report)
    console.print(f"wrote {target}")
