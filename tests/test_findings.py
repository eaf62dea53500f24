"""docs/findings.md is generated, never typed: from constructed results every number on the page is one the facts
hold, the committed page is exactly what its committed facts render to, and a missing run is one line."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from test_answer import d2, documents
from typer.testing import CliRunner

from poolbench.cli.app import app
from poolbench.errors import PoolBenchError
from poolbench.results.pages.findings import findings_facts, render_findings, write_findings

DOCS = Path(__file__).resolve().parents[1] / "docs"
# A number standing alone (not part of a name such as A1_mean, L2 or a hash); the minus may be typographic.
NUMBER = re.compile(r"(?<![\w.`-])[-+−]?\d+(?:\.\d+)?(?![\w`])")


def numbers_on(page: str) -> set[str]:
    """Every number the page shows, outside code spans (paths, hashes)."""
    return {m.group().lstrip("+").replace("−", "-") for m in NUMBER.finditer(re.sub(r"`[^`]*`", "", page))}


def numbers_in(facts: object) -> set[str]:
    """Every way the renderer may print a value the facts hold, and the numbers inside the facts' sentences."""
    found: set[str] = set()
    if isinstance(facts, dict):
        for v in facts.values():
            found |= numbers_in(v)
    elif isinstance(facts, list):
        for v in facts:
            found |= numbers_in(v)
    elif isinstance(facts, str):
        found |= numbers_on(facts)
    elif isinstance(facts, (int, float)) and not isinstance(facts, bool):
        found |= {f"{facts:.3f}", f"{facts:.1f}", f"{facts:.2f}", f"{facts:.4f}"} | (  # .4f: near-tie margins
            {str(facts)} if isinstance(facts, int) else set())
        found |= {s.lstrip("+") for s in (f"{facts:+.3f}",)}
    return found


def run_folder(tmp_path: Path) -> Path:
    results, board = documents(d2=[d2("c1", "A"), d2("c3", "A", delta=(0.2, 0.1, 0.3), prompted=(0.0, -0.05, 0.05))])
    results.update({"date": "2026-01-02T03:04:05Z", "git_hash": "0123456789abcdef", "seed": 7, "layers": [1, 2],
                    "corpus": {"source": "embedded", "size": "tiny", "hash": "feedfacecafebeef"},
                    "config": {"n_bootstrap": 200}, "timing": {"total_s": 93.0, "pool_s": 61.5}})
    results["model"].update({"n_layers": 4, "dtype": "float32"})
    for cell in results["cells"]:
        cell.update({"n_train": 10, "n_test": 6})
    board["by_tier"] = {"hard": {"rows": [{"strategy": "B", "layer": 1, "auroc": 0.8, "ci_low": 0.7, "ci_high": 0.9},
                                          {"strategy": "A", "layer": 2, "auroc": 0.6, "ci_low": 0.45, "ci_high": 0.75}],
                                 "n_others": 1, "n_excluded_by_best": 1, "separates": True,
                                 "lexical": {"mean": 0.55, "max": 0.62}}}
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "leaderboard.json").write_text(json.dumps(board))
    return folder


def test_findings_from_constructed_results(tmp_path):
    folder = run_folder(tmp_path)
    page_path, facts_path = write_findings(folder, tmp_path / "docs")
    page, facts = page_path.read_text(), json.loads(facts_path.read_text())
    assert facts["source"]["sha256"] == hashlib.sha256((folder / "results.json").read_bytes()).hexdigest()
    assert facts["run"]["minutes"] == {"total": pytest.approx(1.55), "pool": pytest.approx(1.025)}  # 93 s, 61.5 s
    assert (facts["run"]["n_concepts"], facts["run"]["n_train"], facts["run"]["n_test"]) == (4, 40, 24)
    assert facts["leaderboard"][0]["mean_d1"] == pytest.approx(0.875)
    assert facts["leaderboard"][0]["low"] == pytest.approx(0.875 - 0.102714, abs=1e-6)
    assert [r["best_d1"] for r in facts["lexical"]] == [0.9, 0.8, 0.85, 0.95]  # A's D1 beside the words
    assert "- wall time (minutes): total 1.6, pool 1.0" in page
    assert "| 1 | A | f | 2 | 0.875 [0.772, 0.978] | 0.895 | chosen best | — | c2 0.800 |" in page
    # B against A over four concepts: W = 0 of three non-zero differences, Holm p 0.25 (test_answer by hand)
    assert "| B | 2 | not separated | Wilcoxon signed-rank, Holm; Bayesian signed-rank test, ROPE | +0.037 | 4 | " \
           "0.250 |" in page
    assert [c["strategy"] for c in facts["answer"]["comparisons"]] == ["B", "C"] and facts["answer"]["best"] == "A"
    assert "| c3 | 0.750 [0.650, 1.000] | 0.850 |" in page
    assert "| A | 2 | 0.600 [0.450, 0.750] |" in page and "lexical baseline's mean is 0.550, its max 0.620" in page
    # steered fluent: "—", the record predates D2 v4 (no passes_fluency_guard); prompted fluent from its ratio
    assert "| c3 | A | 2 | 0.100 | +0.200 [+0.100, +0.300] | +0.000 [-0.050, +0.050] | — | yes |" in page
    assert ("- No strategy but A reaches rank 1, yet not every other is separated from it; the lexical baseline "
            "scores 1.000 on 3 of 4 concepts, so this corpus cannot separate them.") in page
    assert "tied" not in page
    unexplained = numbers_on(page) - numbers_in(facts)
    assert not unexplained, f"numbers on the page that the facts do not hold: {sorted(unexplained)}"


def test_the_page_is_deterministic_and_only_formats_its_facts(tmp_path):
    folder = run_folder(tmp_path)
    first = write_findings(folder, tmp_path / "a")[0].read_text()
    assert write_findings(folder, tmp_path / "b")[0].read_text() == first
    results = json.loads((folder / "results.json").read_text())
    board = json.loads((folder / "leaderboard.json").read_text())
    facts = findings_facts(results, board, source="x/results.json", sha256="0" * 64)
    facts["leaderboard"][0]["mean_d1"] = 0.123  # a changed fact shows, nothing is recomputed
    assert "0.123 [0.772, 0.978]" in render_findings(facts)


def test_committed_findings_page_is_what_its_facts_render_to():
    facts = json.loads((DOCS / "findings.json").read_text(encoding="utf-8"))
    page = (DOCS / "findings.md").read_text(encoding="utf-8")
    assert page == render_findings(facts), "docs/findings.md was edited by hand: run `poolbench-driver findings`"
    assert not numbers_on(page) - numbers_in(facts)


def test_missing_run_is_one_line(tmp_path):
    with pytest.raises(PoolBenchError, match=r"^no results.json in "):
        write_findings(tmp_path / "nope", tmp_path / "docs")
    result = CliRunner().invoke(app, ["findings", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "d")])
    assert result.exit_code != 0 and isinstance(result.exception, PoolBenchError)
    assert not (tmp_path / "d").exists()
