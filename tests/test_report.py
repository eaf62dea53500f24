"""The HTML report: built from a synthetic run, rendered in headless Chromium, every figure on screen and not blank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from record_samples import d2_record, scorer_validity

from poolbench.errors import PoolBenchError
from poolbench.prober.reliability import across_cells
from poolbench.records.d1 import D1CellRecord
from poolbench.results.leaderboard import build_leaderboard
from poolbench.results.report import load_runs, render_report, write_report

CONCEPTS = ("hedging", "toxicity", "planning")
STRATEGIES = ("A1_mean", "P1_last", "W2_last_k")
# test AUROC per strategy and layer (same for every concept but a per-concept offset), cv = test - 0.01
D1 = {"A1_mean": (0.80, 0.90), "P1_last": (0.70, 0.60), "W2_last_k": (0.75, 0.85)}
OFFSET = {"hedging": 0.0, "toxicity": 0.05, "planning": -0.05}
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
FIGURE_PROBE = """<script>window.addEventListener('load', () => {
  const figs = [...document.querySelectorAll('img[data-figure]')].map(img => {
    const r = img.getBoundingClientRect();
    return {id: img.dataset.figure, complete: img.complete, naturalWidth: img.naturalWidth,
            naturalHeight: img.naturalHeight, x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height};
  });
  const pre = document.createElement('pre'); pre.id = 'figure-probe';
  pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight, figures: figs});
  document.body.appendChild(pre);
});</script>"""


def synthetic_cells() -> list[dict]:
    cells = []
    for concept in CONCEPTS:
        for strategy in STRATEGIES:
            for layer in (0, 1):
                auroc = round(D1[strategy][layer] + OFFSET[concept], 4)
                for probe in ("logistic", "diffmean"):
                    cells.append({"concept": concept, "layer": layer, "strategy": strategy, "probe": probe,
                                  "cv_auroc": auroc - 0.01, "test_auroc": auroc, "ci_low": auroc - 0.05,
                                  "ci_high": min(1.0, auroc + 0.05), "fallback_count": 0,
                                  "fallback_rate": 0.6 if strategy == "W2_last_k" else 0.0})
    return cells


def alpha_row(alpha: float) -> dict:
    return {"alpha": alpha, "score": 0.2 + 0.1 * alpha, "perplexity": 3.0, "fluency_ratio": 1.0, "relevance": 0.5,
            "fluency01": 1.0, "hm": 0.4}


def write_run(folder: Path, *, with_d2: bool = True) -> Path:
    cells = synthetic_cells()
    reliability = across_cells(cells)
    results = {"model": {"model_id": "tiny"}, "corpus": {"hash": "c0ffee"}, "git_hash": "abc", "date": "today",
               "cells": cells, "reliability": reliability}
    if with_d2:
        results["d2"] = [d2_record(concept=c, strategy=s, layer=1, per_alpha=[alpha_row(a) for a in (0.0, 1.0, 2.0)])
                         .to_dict() for c in CONCEPTS[:2] for s in STRATEGIES[:2]]
        results["d2"].append(d2_record(status="null", null_reason="zero-norm", scp=None, d2_delta=None).to_dict())
        results["scorers"] = [scorer_validity(concept=c, min_auroc=0.8).to_dict() for c in CONCEPTS]
    board = build_leaderboard([D1CellRecord.from_dict(c) for c in cells], win_rate=reliability["win_rate"],
                              average_ranks=reliability["friedman"]["average_ranks"])
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "leaderboard.json").write_text(json.dumps(board))
    return folder


def test_report_sections_and_numbers(tmp_path):
    runs = load_runs(write_run(tmp_path / "run"))
    page, figures = render_report(runs)
    assert [f.fig_id for f in figures] == ["run0-heatmap", "run0-layers", "run0-alpha", "run0-cd", "run0-fallback",
                                           "run0-scorer"]
    assert all(f.png.startswith(b"\x89PNG") and len(f.png) > 5000 for f in figures)
    # Per strategy the CV-best layer: A1 and W2 at layer 1 (cv 0.89, 0.84), P1 at layer 0 (0.69 > 0.59); mean D1
    # over concepts is the layer's value (offsets +0, +0.05, -0.05 cancel). A1 beats both others in all six
    # (concept, layer) units, W2 beats P1 in all: win rates 1, 0.5, 0 and average ranks 1, 2, 3.
    for strategy, cells in (("A1_mean", "0.900 0.890 1 1.000 1.000"), ("W2_last_k", "0.850 0.840 1 0.500 2.000"),
                            ("P1_last", "0.700 0.690 0 0.000 3.000")):
        expected = "".join(f"<td>{v}</td>" for v in [strategy, *cells.split()])
        assert f"<tr>{expected}" in page
    assert page.count("data:image/png;base64,") == 6
    assert "http://" not in page and "https://" not in page  # self-contained


def test_report_without_d2_or_scorers_says_so(tmp_path):
    _, figures = render_report(load_runs(write_run(tmp_path / "run", with_d2=False)))
    assert [f.fig_id for f in figures] == ["run0-heatmap", "run0-layers", "run0-cd", "run0-fallback"]


def test_report_of_a_folder_of_runs_and_bad_input(tmp_path):
    write_run(tmp_path / "runs" / "a")
    write_run(tmp_path / "runs" / "b", with_d2=False)
    figures = write_report(tmp_path / "runs", tmp_path / "r.html")
    assert {f.fig_id.split("-")[0] for f in figures} == {"run0", "run1"}
    with pytest.raises(PoolBenchError, match=r"no results\.json in"):
        load_runs(tmp_path / "missing")
    bad = tmp_path / "runs" / "a" / "results.json"
    results = json.loads(bad.read_text())
    results["d2"][0]["scp"] = "high"
    bad.write_text(json.dumps(results))
    with pytest.raises(PoolBenchError) as err:
        load_runs(tmp_path / "runs" / "a")
    assert str(err.value) == f"{bad}: D2Record: field 'scp': Input should be a valid number (got 'high')"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium; "
                                            "`make test-deps` does it)")
def test_report_renders_every_figure_in_headless_chromium(tmp_path):
    figures = write_report(write_run(tmp_path / "run"), tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.replace("</body>", FIGURE_PROBE + "</body>"))
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--window-size=1200,900", "--virtual-time-budget=5000", "--dump-dom",
                          probe_page.as_uri()], capture_output=True, text=True, timeout=60, check=True).stdout
    found = re.search(r'<pre id="figure-probe">(.*?)</pre>', dom, re.S)
    assert found, "the page's load handler did not run"
    probe = json.loads(found.group(1).replace("&quot;", '"'))
    assert [f["id"] for f in probe["figures"]] == [f.fig_id for f in figures]

    shot = tmp_path / "shot.png"
    subprocess.run([*base, f"--window-size=1200,{probe['height']}", f"--screenshot={shot}", probe_page.as_uri()],
                   capture_output=True, timeout=60, check=True)
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[0] == probe["height"]
    for fig in probe["figures"]:
        assert fig["complete"] and fig["naturalWidth"] > 100 and fig["naturalHeight"] > 100, fig
        assert fig["w"] > 100 and fig["h"] > 100, fig
        x, y, w, h = (round(fig[k]) for k in ("x", "y", "w", "h"))
        region = pixels[y:y + h, x:x + w]
        assert region.shape[:2] == (h, w), f"{fig['id']} lies outside the screenshot"
        non_white = (region < 240).any(axis=2).mean()
        colours = len(np.unique(region.reshape(-1, 3) // 16, axis=0))
        assert non_white > 0.02 and colours > 8, f"{fig['id']} is blank on screen ({non_white=:.3f}, {colours=})"
