"""README numbers come from the results they describe: the README holds none, it links the generated findings page,
and it stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MEASURED = (re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"),  # a decimal: an AUROC, a Δ, a p-value, minutes
            re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|sec|min|minutes|hours|MB|GB|GiB|req/s|tokens/s)\b"))


def prose(text: str) -> str:
    """The README without fenced blocks and inline code, where options, versions and paths are written."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))


def measured_numbers(text: str) -> list[str]:
    return [m.group() for pattern in MEASURED for m in pattern.finditer(prose(text))]


def test_the_check_catches_numbers_copied_from_a_run():
    assert measured_numbers("S2_gradient 0.984 [0.969, 0.999], run in 20.5 min, p = 5e-35") == [
        "0.984", "0.969", "0.999", "20.5", "20.5 min"]
    assert measured_numbers("took 1,228 s; `--n-bootstrap 1.5` and ```\n0.5\n``` are code") == ["228 s"]


def test_readme_holds_no_measured_number_and_links_the_generated_findings():
    text = README.read_text(encoding="utf-8")
    assert measured_numbers(text) == []
    assert "](docs/findings.md)" in text and (ROOT / "docs" / "findings.md").is_file()
    assert len(text.splitlines()) <= 250
