"""docs/reproducibility.md: every line of its contract names the tests that check it, and each named test exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "reproducibility.md"
REFERENCE = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")


def contract_lines(text: str) -> list[str]:
    """The bullets of the doc's "## The contract" section, each joined onto one line."""
    section = text.split("## The contract", 1)[1].split("\n## ", 1)[0]
    return [" ".join(bullet.split()) for bullet in re.split(r"\n- ", "\n" + section.strip())[1:]]


def test_every_contract_line_names_tests_that_exist() -> None:
    lines = contract_lines(DOC.read_text())
    assert len(lines) >= 8
    for line in lines:
        references = REFERENCE.findall(line)
        assert references, f"no test named for: {line[:80]}"
        for file, name in references:
            tree = ast.parse((ROOT / "tests" / file).read_text())
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            assert name in defined, f"docs/reproducibility.md names tests/{file}::{name}, which does not exist"


def test_the_doc_check_fails_on_a_line_without_a_test() -> None:
    """Should-fail side: a contract bullet naming no test is found."""
    text = "## The contract\n\n- **A.** Tests: tests/test_x.py::test_a.\n- **B.** nothing named\n\n## Next\n- x"
    lines = contract_lines(text)
    assert lines == ["**A.** Tests: tests/test_x.py::test_a.", "**B.** nothing named"]
    assert [bool(REFERENCE.findall(line)) for line in lines] == [True, False]

