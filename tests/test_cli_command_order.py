"""`poolbench-driver --help` lists commands in the order a user needs them (COMMAND_ORDER), every command named."""

from __future__ import annotations

import re

import typer
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.cli.command_order import COMMAND_ORDER


def listed_commands(help_text: str) -> list[str]:
    """The command names in the help's Commands panel, top to bottom (each row starts `│ name  `)."""
    panel = help_text.split("Commands", 1)[1]
    return re.findall(r"^│ ([a-z][a-z-]*) ", panel, flags=re.MULTILINE)


def test_help_lists_every_command_in_the_order_a_user_needs_them() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"})
    assert result.exit_code == 0, result.output
    listed = listed_commands(result.output)
    assert listed == list(COMMAND_ORDER)
    assert listed[:4] == ["run", "leaderboard", "report", "findings"] and listed[-1] == "cluster"
    registered = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert registered == set(COMMAND_ORDER)  # a new command must be given its place


def test_a_command_not_in_the_order_comes_last() -> None:
    extra = typer.Typer(cls=type(typer.main.get_command(app)))
    for name in ("zz-new", "cluster", "run"):
        extra.command(name)(lambda: None)
    group = typer.main.get_command(extra)
    assert group.list_commands(typer.Context(group)) == ["run", "cluster", "zz-new"]  # type: ignore[attr-defined]
