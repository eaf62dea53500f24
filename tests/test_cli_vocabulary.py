"""One name per meaning across every driver command, and a driver that starts without the heavy libraries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.cli.options import RENAMED, SYNONYMS, rewrite_old_names
from poolbench.cli.report import report_target


def walk(command, path: tuple[str, ...] = ()):
    """(command path, parameter) for every parameter of every command under `command` (Typer's own click)."""
    for param in command.params:
        yield path, param
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from walk(sub, (*path, name))


def visible_params(typer_app: typer.Typer = app):
    return [(path, p) for path, p in walk(typer.main.get_command(typer_app)) if not getattr(p, "hidden", False)]


def synonym_offenders(typer_app: typer.Typer = app) -> set[tuple[str, str, str]]:
    return {(" ".join(path), opt, chosen) for path, p in visible_params(typer_app) for opt in p.opts
            for chosen, synonyms in SYNONYMS.items() if opt in synonyms}


def test_no_visible_option_uses_a_synonym_of_a_chosen_name():
    assert synonym_offenders() == set()


def test_the_synonym_check_catches_a_second_name():
    bad = typer.Typer()

    @bad.command("a")
    def a(n_bootstrap: int = typer.Option(1)) -> None: ...

    @bad.command("b")
    def b(resamples: int = typer.Option(1, "--bootstrap")) -> None: ...

    assert synonym_offenders(bad) == {("b", "--bootstrap", "--n-bootstrap")}


def test_the_walk_finds_every_command_and_the_shared_names():
    names = {(" ".join(path), opt) for path, p in visible_params() for opt in p.opts}
    assert {("run", "--n-bootstrap"), ("calibrate", "--n-bootstrap"), ("bias", "--n-bootstrap"),
            ("power", "--n-bootstrap"), ("flash-check", "--n-bootstrap"), ("report", "--run"),
            ("leaderboard", "--run"), ("power", "--run"), ("flash-check", "--run"),
            ("export-submission", "--run"), ("run", "--out")} <= names


def test_out_always_names_a_folder_and_runs_are_options():
    for path, p in visible_params():
        if "--out" in p.opts:
            default = p.default if p.default not in (None, ...) else None
            assert default is None or Path(str(default)).suffix == "", (path, default)
            assert "folder" in (p.help or ""), (path, p.help)
            assert "file" not in (p.help or "").replace("folder", ""), (path, p.help)
        if p.param_type_name == "argument":
            assert p.name not in ("run_dir", "run"), (path, p.name)
    runs = [p.default for path, p in visible_params() if "--run" in p.opts and p.default not in (None, ...)]
    assert {str(d) for d in runs} <= {"runs/default"}


def test_old_names_are_rewritten_with_a_warning():
    warnings: list[str] = []
    args = ["run", "--bootstrap", "10", "--output-path=x", "--", "--bootstrap"]
    assert rewrite_old_names(args, warnings.append) == ["run", "--n-bootstrap", "10", "--out=x", "--", "--bootstrap"]
    assert len(warnings) == 2 and "--bootstrap is now --n-bootstrap" in warnings[0]
    assert rewrite_old_names(["report", "--html", "h", "runs/a"]) == ["report", "--html", "h", "--run", "runs/a"]
    assert rewrite_old_names(["leaderboard", "runs/a"]) == ["leaderboard", "--run", "runs/a"]
    assert rewrite_old_names(["report", "--run=runs/a", "--help"]) == ["report", "--run=runs/a", "--help"]
    assert set(RENAMED.values()) <= set(SYNONYMS)


def test_old_names_still_parse_through_the_driver(tmp_path: Path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "leaderboard.json").write_text(json.dumps({"probe": "logistic", "strategies": []}))
    new = CliRunner().invoke(app, ["leaderboard", "--run", str(run)])
    old = CliRunner().invoke(app, ["leaderboard", str(run)])
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)
    assert "D1 leaderboard" in new.output and "D1 leaderboard" in old.output


def test_report_html_names_a_folder():
    assert report_target(Path("out"), Path("runs/x")) == Path("out/report.html")
    assert report_target(None, Path("runs/x")) == Path("runs/x/report.html")
    assert report_target(Path("page.html"), Path("runs/x")) == Path("page.html")


def test_importing_the_driver_loads_no_heavy_library():
    code = ("import sys, poolbench.cli.app; "
            "print(sorted(m for m in ('torch', 'ray', 'matplotlib', 'transformers', 'sklearn', 'scipy', 'numpy', "
            "'minio', 'poolbench.results.pages.report') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
