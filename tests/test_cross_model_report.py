"""The cross-model report and findings page from two synthetic model folders: the answer box carries W, both
figures are drawn, every figure is on screen in headless Chromium, and the findings page says who is best where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from browser import CHROMIUM, assert_drawn, figures_on_screen
from test_report import write_run

from poolbench.errors import PoolBenchError
from poolbench.results.documents.cross_model_outputs import write_cross_model_outputs
from poolbench.results.pages.cross_model_findings import write_cross_model_findings
from poolbench.results.pages.cross_model_report import write_cross_model_report

FOLDERS = {"small": "small", "deep": "deep"}


def cross_run(root: Path) -> Path:
    """Two copies of test_report's synthetic run (A1_mean best at layer 1) as models of 2 and 5 layers."""
    for name, n_layers in (("small", 2), ("deep", 5)):
        folder = write_run(root / name, with_d2=False)
        board = json.loads((folder / "leaderboard.json").read_text())
        board["model"] = {"model_id": f"org/{name}", "n_layers": n_layers}
        (folder / "leaderboard.json").write_text(json.dumps(board))
    write_cross_model_outputs(root, FOLDERS, config={"model": list(FOLDERS)}, timing={"total_s": 60.0},
                              n_bootstrap=100, seed=0)
    return root


def test_cross_model_page_and_findings(tmp_path: Path) -> None:
    run = cross_run(tmp_path / "run")
    figures = write_cross_model_report(run, tmp_path / "report.html")
    assert [f.fig_id for f in figures][:2] == ["cross-heatmap", "cross-depth"]
    assert [f.fig_id for f in figures][2:] == ["run0-cd", "run0-heatmap", "run0-layers", "run0-fallback",
                                               "run1-cd", "run1-heatmap", "run1-layers", "run1-fallback"]
    page = (tmp_path / "report.html").read_text()
    assert page.index("Answer across models") < page.index("org/small")
    assert 'data-kendall-w="1.000000"' in page
    assert "A1_mean is the best strategy in every model" in page
    # the deeper model's chosen layer 1 of 5 is relative depth 0.25; the 2-layer model's layer 1 is 1.00
    assert "L1 (1.00)" in page and "L1 (0.25)" in page

    findings, facts = write_cross_model_findings(run, tmp_path / "docs")
    text = findings.read_text()
    assert "- A1_mean is the best strategy in every model (small (org/small) and deep (org/deep))." in text
    assert "Kendall's W = 1.00" in text and "## small" in text and "### Leaderboard" in text
    assert json.loads(facts.read_text())["cross_model"]["best"]["in_every_model"] == ["A1_mean"]

    with pytest.raises(PoolBenchError, match="no cross-model run"):
        write_cross_model_report(run / "small", tmp_path / "x.html")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium; "
                                            "`make test-deps` does it)")
def test_cross_model_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    run = cross_run(tmp_path / "run")
    figures = write_cross_model_report(run, tmp_path / "report.html")
    on_screen, pixels = figures_on_screen(tmp_path / "report.html", tmp_path)
    assert [f["id"] for f in on_screen] == [f.fig_id for f in figures]
    for fig in on_screen[:2]:  # the cross-model figures; test_report checks the per-model ones
        assert_drawn(fig, pixels)


def test_the_committed_cross_model_findings_page_is_generated_from_its_facts() -> None:
    from poolbench.results.pages.cross_model_findings import render_cross_model_findings

    docs = Path(__file__).resolve().parents[1] / "docs" / "across-models-run"
    facts = json.loads((docs / "findings.json").read_text())
    assert (docs / "findings.md").read_text() == render_cross_model_findings(facts), \
        "docs/across-models-run/findings.md was edited by hand: run `poolbench-driver findings`"
