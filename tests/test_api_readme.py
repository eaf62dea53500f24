"""README's Python API example runs as written (the test model and a temporary folder substituted), and the
samples it logs reproduce each reported D1 passage by passage."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from sklearn.metrics import roc_auc_score

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README's Python API section has no python block"
    return match.group(1)



def test_the_readme_api_example_runs_and_its_samples_reproduce_d1(tiny_llama_dir, local_ray, cache, tmp_path,
                                                                  capsys):
    code = readme_example()
    assert 'model="tiny"' in code and '"runs/api-demo"' in code
    out = tmp_path / "api-demo"
    code = code.replace('model="tiny"', f"model={str(tiny_llama_dir)!r}").replace('"runs/api-demo"', repr(str(out)))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # the documented example itself

    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "(2, 32)"  # two texts, the test model's width
    results = namespace["results"]
    assert sorted(results.paths) == ["answer", "answer_stamped", "leaderboard", "leaderboard_long",
                                     "leaderboard_stamped", "leaderboard_wide", "passage_scores", "results",
                                     "results_stamped", "samples"]
    assert all(p.parent == out and p.is_file() for p in results.paths.values())
    # 2 concepts x 2 layers x 2 strategies x 2 probes
    assert len(results.cells) == 16 and printed[1] == f"16 D1 cells; {sorted(results.paths)}"

    rows = [json.loads(line) for line in results.paths["samples"].read_text().splitlines()]
    by_cell: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for row in rows:
        by_cell[(row["concept"], row["strategy"], row["layer"])].append(row)
    chosen = {(c, r["strategy"], r["best_layer"]) for r in results.leaderboard["strategies"] for c in r["per_concept"]}
    assert set(by_cell) == chosen
    d1 = {(c.concept, c.strategy, c.layer): c for c in results.cells if c.probe == "logistic"}
    for key, cell_rows in by_cell.items():
        assert len(cell_rows) == d1[key].n_test
        assert {r["prediction"] for r in cell_rows} <= {0, 1}
        assert all(r["prediction"] == int(r["score"] > 0) for r in cell_rows)
        labels, scores = [r["label"] for r in cell_rows], [r["score"] for r in cell_rows]
        assert roc_auc_score(labels, scores) == pytest.approx(d1[key].test_auroc, abs=1e-12)
