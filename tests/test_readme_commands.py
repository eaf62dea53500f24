"""Every `poolbench-driver <command>` README documents exists: its `--help` runs through the real app."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from poolbench.cli.app import app

README = Path(__file__).resolve().parents[1] / "README.md"
MENTION = re.compile(r"poolbench-driver((?:[ \t]+[A-Za-z][\w-]*)+)")


def documented_commands(text: str, root: object) -> list[tuple[str, ...]]:
    """Command paths named after `poolbench-driver`: through groups to the first non-group word (later words are
    that command's arguments); a word that names nothing ends the path, so its `--help` fails."""
    found: dict[tuple[str, ...], None] = {}
    for match in MENTION.finditer(text):
        path, node = [], root
        for word in match.group(1).split():
            subcommands = getattr(node, "commands", None)  # groups only (Typer ships its own click)
            if not isinstance(subcommands, dict):
                break
            path.append(word)
            node = subcommands.get(word)
            if node is None:
                break
        found[tuple(path)] = None
    return list(found)


ROOT = typer.main.get_command(app)
COMMANDS = documented_commands(README.read_text(encoding="utf-8"), ROOT)


def test_the_parser_reads_paths_through_groups_and_keeps_unknown_names():
    text = ("`poolbench-driver sae train --model embedded`, `poolbench-driver report runs/default --html r.html`, "
            "`.venv/bin/poolbench-driver run \\`, poolbench-driver sae-train and `poolbench-driver list concepts`")
    assert documented_commands(text, ROOT) == [("sae", "train"), ("report",), ("run",), ("sae-train",),
                                               ("list", "concepts")]


def test_readme_documents_the_main_commands():
    assert {("run",), ("report",), ("validate-corpus",), ("corpus", "build"), ("sae", "train"), ("power",),
            ("flash-check",), ("list", "strategies"), ("list", "concepts"), ("list", "models")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_documented_command_has_help(path):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, f"`poolbench-driver {' '.join(path)} --help` failed:\n{result.output}"
    assert f"{' '.join(path)} [OPTIONS]" in result.output


def test_a_command_that_does_not_exist_fails_its_help():
    result = CliRunner().invoke(app, ["sae-train", "--help"])
    assert result.exit_code == 2
    assert "No such command" in result.output


def test_list_strategies_and_concepts_piped_are_one_line_per_name():
    strategies = CliRunner().invoke(app, ["list", "strategies"])
    assert strategies.exit_code == 0, strategies.output
    lines = strategies.output.splitlines()
    assert len(lines) == 23  # the card strategies and the 4 learned contenders; variants only with --all
    assert lines[0].split("\t")[:6] == ["P1_last", "P1", "position_anchored", "none", "-", "card"]
    assert "S3_iti_probe\tS3\tsaliency_weighted\tlabels\tattention, labels\tcard\t" in strategies.output
    assert ("LA3_multimax\tLA3\tlearned_aggregation\tlabels\tlabels, token_states\tcontender, named only\tMultiMax"
            in strategies.output)
    everything = CliRunner().invoke(app, ["list", "strategies", "--all"]).output.splitlines()
    assert any(line.startswith("W4_ref_remainder\tW4\twindow\tnone\t-\treference variant\t") for line in everything)

    concepts = CliRunner().invoke(app, ["list", "concepts"])
    assert concepts.exit_code == 0, concepts.output
    lines = concepts.output.splitlines()
    assert len(lines) == 17 and lines[0] == "academic_tone\tnarrative\tcode_docs\t-"
    assert "imdb_sentiment\tnarrative\tfrustration\tyes" in lines


def test_list_concepts_of_a_corpus_folder_and_a_missing_one(tmp_path):
    for concept in ("b_concept", "a_concept"):
        (tmp_path / concept).mkdir()
        (tmp_path / concept / "train_pos.jsonl").write_text("")
    result = CliRunner().invoke(app, ["list", "concepts", "--corpus", str(tmp_path)])
    assert result.output.splitlines() == ["a_concept\t-\t-\t-", "b_concept\t-\t-\t-"]
    missing = CliRunner().invoke(app, ["list", "concepts", "--corpus", str(tmp_path / "nope")])
    assert missing.exit_code != 0
    assert str(missing.exception) == f"--corpus '{tmp_path / 'nope'}' is not a folder (nor 'embedded')"
