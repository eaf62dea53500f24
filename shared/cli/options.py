"""One name per meaning across every command: the old names still parse for one release, rewritten with a warning.

`--n-bootstrap` (resamples), `--run <folder>` (a finished run), `--out <folder>` (where a command writes, always a
folder). The rewrite happens on the argument list before click parses it, so old names stay out of `--help`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from typer.core import TyperGroup

from poolbench.defaults import DEFAULT_RUN_DIR
from poolbench.errors import PoolBenchError

DEFAULT_RUN = Path(DEFAULT_RUN_DIR)

RENAMED: dict[str, str] = {"--bootstrap": "--n-bootstrap", "--n-resamples": "--n-bootstrap",
                           "--output-path": "--out", "--run-dir": "--run"}
"""Old option name -> the one name it now has (hidden aliases, removed in the next release)."""

SYNONYMS: dict[str, tuple[str, ...]] = {
    "--n-bootstrap": ("--bootstrap", "--n-resamples", "--resamples", "--n-boot"),
    "--out": ("--output", "--output-path", "--output-dir", "--out-dir", "-o"),
    "--run": ("--run-dir", "--run-folder", "--results-dir"),
    "--seed": ("--random-seed", "--rng-seed"),
}
"""The one name of a meaning -> names that would mean the same; no visible option may use the latter."""


POSITIONAL_RUN = ("report", "leaderboard")
"""Commands that took the run folder as their one positional argument; it is `--run <folder>` now."""


def rewrite_old_names(args: Sequence[str], warn=None) -> list[str]:
    """The argument list with every old option name replaced by its new one (also `--old=value`), and the old
    positional run folder of `report` / `leaderboard` given as `--run`."""
    args = _positional_run(list(args), warn)
    out: list[str] = []
    for arg in args:
        if arg == "--":
            out += args[len(out):]
            break
        name, eq, value = arg.partition("=")
        if name in RENAMED:
            if warn is not None:
                warn(f"warning: {name} is now {RENAMED[name]}; the old name goes in the next release")
            arg = RENAMED[name] + eq + value
        out.append(arg)
    return out


def _positional_run(args: list[str], warn) -> list[str]:
    if not args or args[0] not in POSITIONAL_RUN:
        return args
    i = 1
    while i < len(args):
        arg = args[i]
        if arg == "--help":
            i += 1
        elif arg.startswith("-"):
            i += 1 if "=" in arg else 2  # every option of these commands takes a value
        else:
            if warn is not None:
                warn(f"warning: the run folder is now --run {arg}; the positional form goes in the next release")
            return [*args[:i], "--run", *args[i:]]
    return args


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class RenamingGroup(TyperGroup):
    """The root command group: old option names are rewritten before any subcommand parses them."""

    def main(self, args: Sequence[str] | None = None, *pargs: Any, **kwargs: Any) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        return super().main(rewrite_old_names(args, _stderr), *pargs, **kwargs)


def out_folder(out: Path, option: str = "--out") -> Path:
    """`--out` names a folder; a path ending in a file suffix is the old meaning, refused in one line."""
    if out.suffix in (".json", ".jsonl", ".html", ".safetensors", ".npz"):
        raise PoolBenchError(f"{option} {out}: {option} is a folder now (the file name is fixed); "
                             f"give --out {out.parent}")
    return out


