"""docs/reproducibility.md: every line of its contract names the tests that check it, and each named test exists;
plus the line no other test checks: a run with another batch budget and thread count reuses the stored tables."""

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


def test_a_run_with_another_budget_and_threads_reuses_the_stored_tables(tiny_llama_dir, local_ray, cache,
                                                                        tmp_path) -> None:
    """The pooled and D1 keys hold neither the batch budget nor the threads: the second run computes nothing and
    its records are the stored ones, bit for bit (read, not recomputed)."""
    from poolbench.config import RunConfig
    from poolbench.driver.pipeline import run_benchmark

    base = dict(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging",),
                strategies=("A1_mean", "P1_last"), store=str(tmp_path / "store"), n_bootstrap=50, steering=False)
    first = run_benchmark(RunConfig(**base, torch_threads=1))
    again = run_benchmark(RunConfig(**base, torch_threads=2, max_batch_tokens=16))
    assert again.computed == {"pooled": 0, "d1": 0, "pooled_skipped": 1, "d1_skipped": 1}
    assert again.artifacts == first.artifacts
    assert [r.to_dict() for r in again.records] == [r.to_dict() for r in first.records]
