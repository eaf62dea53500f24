"""How fast the driver answers before any work: `--help`, `list models`, a subcommand's help.

Each command runs `--repeats` times in a fresh process; wall time is what a person waits, CPU time (user + sys of
the child) is what the driver itself spent, which a busy shared machine does not inflate. Prints a table and
writes bench/results/cli_startup.json. Targets: --help < 0.5 s, list models < 2 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = {"--help": (["--help"], 0.5), "list models": (["list", "models"], 2.0),
            "run --help": (["run", "--help"], 0.5), "list strategies": (["list", "strategies"], 2.0)}


def time_command(args: list[str]) -> tuple[float, float]:
    """(wall s, child CPU s) of one fresh driver process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from poolbench.cli.app import main; main()", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    from bench_io import RESULTS, write_result
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "cli_startup.json")
    args = parser.parse_args()
    rows = {}
    for name, (argv, target) in COMMANDS.items():
        time_command(argv)  # warm the page cache once
        samples = [time_command(argv) for _ in range(args.repeats)]
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        rows[name] = {"argv": argv, "target_s": target, "wall_median_s": statistics.median(walls),
                      "wall_min_s": min(walls), "cpu_median_s": statistics.median(cpus),
                      "meets_target": statistics.median(walls) < target}
    table = Table("command", "wall median s", "wall min s", "CPU median s", "target s", "met",
                  title=f"poolbench-driver startup ({args.repeats} fresh processes each, {os.cpu_count()} cores)")
    for name, row in rows.items():
        table.add_row(name, f"{row['wall_median_s']:.3f}", f"{row['wall_min_s']:.3f}", f"{row['cpu_median_s']:.3f}",
                      f"{row['target_s']}", "yes" if row["meets_target"] else "NO")
    Console().print(table)
    write_result({"benchmark": "cli_startup", "python": sys.version.split()[0], "repeats": args.repeats,
                  "load_average": os.getloadavg(), "commands": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
