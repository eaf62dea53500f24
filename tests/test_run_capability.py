"""`run --capability-task`: the task checked in one line before any work; after steering, lm-eval scores the task
against the run's own steered cell at alpha* and at 0, and the difference with its interval lands in
capability.json, results.json, answer.json, the printed answer, the findings page and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_capability import DOCS, hand_accuracy

from poolbench.capability.measure import CapabilityError, CapabilityRecord
from poolbench.capability.records import check_capability_task, record_capability, steered_cells
from poolbench.results.answer.answer import build_answer, write_answer

DRIVER = [sys.executable, "-c", "from poolbench.cli.app import main; main()"]
TASK_YAML = ("task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
             "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: choices\n"
             "doc_to_target: label\nmetric_list:\n  - metric: acc\n")


def task_folder(root: Path, docs: Path | None = None) -> Path:
    """A task folder: tiny_choice's YAML over a local JSONL file (the 8 documents of test_capability)."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "tiny_choice.yaml").write_text(TASK_YAML.format(docs=docs or data))
    return root


def test_a_missing_task_folder_stops_the_run_in_one_line_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([*DRIVER, "run", "--model", "tiny", "--corpus-size", "tiny", "--out", str(out),
                           "--capability-task", "tiny_choice", "--capability-task-dir", str(tmp_path / "no-tasks")],
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: --capability-task-dir: {tmp_path / 'no-tasks'} is not a folder"
    assert not out.exists()  # nothing started, nothing written


def test_the_python_api_checks_the_task_before_any_work(tmp_path):
    import poolbench

    tasks = task_folder(tmp_path / "tasks")
    with pytest.raises(CapabilityError, match=r"^--capability-task: needs the steering stage"):
        poolbench.evaluate(model="tiny", out=tmp_path / "run", steering=False, capability_task="tiny_choice",
                           capability_task_dir=tasks)
    with pytest.raises(CapabilityError, match=r"is not a folder$"):
        poolbench.evaluate(model="tiny", out=tmp_path / "run", capability_task="tiny_choice",
                           capability_task_dir=tmp_path / "none")
    assert not (tmp_path / "run").exists()


def test_the_task_check_names_what_is_missing(tmp_path):
    tasks = task_folder(tmp_path / "tasks")
    check_capability_task("tiny_choice", tasks, steering=True)  # complete: passes
    with pytest.raises(CapabilityError, match=r"^--capability-task: needs the steering stage"):
        check_capability_task("tiny_choice", tasks, steering=False)
    with pytest.raises(CapabilityError, match=rf"^--capability-task: no YAML in {tasks} defines task 'other'"):
        check_capability_task("other", tasks, steering=True)
    gone = task_folder(tmp_path / "gone", docs=tmp_path / "gone" / "missing.jsonl")
    with pytest.raises(CapabilityError) as missing:
        check_capability_task("tiny_choice", gone, steering=True)
    assert str(missing.value) == (f"{gone / 'tiny_choice.yaml'}: dataset_kwargs.data_files: "
                                  f"{gone / 'missing.jsonl'} does not exist")


def test_records_go_into_results_answer_and_capability_json(tmp_path):
    """By hand: two records, one a cost (interval below 0), written into a run folder that already had one
    record of the same cell (replaced) and one of another task (kept)."""
    run = tmp_path / "run"
    run.mkdir()
    old_same = CapabilityRecord("tiny_choice", "acc", "praise", "A1_mean", 1, 4.0, 8, 0.5, 0.5, 0.0, 0.0, 0.0, 200)
    other = CapabilityRecord("other", "acc", "praise", "A1_mean", 1, 4.0, 8, 0.5, 0.5, 0.0, 0.0, 0.0, 200)
    (run / "results.json").write_text(json.dumps({"model": {"model_id": "m"}, "d2": [
        {"concept": "praise", "strategy": "A1_mean", "layer": 1, "alpha_star": 4.0},
        {"concept": "praise", "strategy": "P1_last", "layer": 1, "alpha_star": None}]}))
    (run / "leaderboard.json").write_text(json.dumps({"strategies": []}))
    write_answer(build_answer(json.loads((run / "results.json").read_text()), {"strategies": []}),
                 run / "answer.json")
    (run / "capability.json").write_text(json.dumps([old_same.to_dict(), other.to_dict()]))
    assert steered_cells(json.loads((run / "results.json").read_text())) == [("praise", "A1_mean", 1, 4.0)]
    cost = CapabilityRecord("tiny_choice", "acc", "praise", "A1_mean", 1, 4.0, 8, 0.625, 0.25, -0.375, -0.625,
                            -0.125, 200)
    record_capability(run, [cost])
    assert json.loads((run / "capability.json").read_text()) == [other.to_dict(), cost.to_dict()]
    assert json.loads((run / "results.json").read_text())["capability"] == [cost.to_dict()]
    (section,) = json.loads((run / "answer.json").read_text())["sections"]
    assert section["key"] == "capability"
    assert section["sentences"][1] == ("tiny_choice acc steered by praise/A1_mean L1 at α 4: 0.250 against 0.625 "
                                       "unsteered, difference -0.375 [-0.625, -0.125] over 8 documents (a cost).")
    assert section["sentences"][0].endswith("difference +0.000 [+0.000, +0.000] over 8 documents (no difference "
                                            "the interval separates).")
    assert section["values"]["tiny_choice/praise/A1_mean/L1/alpha=4/difference"] == -0.375


@pytest.mark.slow
def test_a_tiny_run_scores_its_steered_cell_on_the_task(tiny_llama_dir, tmp_path):
    """`run` on the tiny Llama, one concept and strategy, steering on, with --capability-task: lm-eval (offline,
    local JSONL) through the run's own service (slow: a run with D2 and two lm-eval passes, minutes on 2 cores)."""
    out, tasks = tmp_path / "run", task_folder(tmp_path / "tasks")
    env = {**os.environ, "POOLBENCH_CACHE": str(tmp_path / "cache"), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [*DRIVER, "run", "--model", str(tiny_llama_dir), "--corpus-size", "tiny", "--concepts", "frustration",
         "--strategies", "A1_mean", "--n-bootstrap", "100", "--torch-threads", "1", "--no-reliability",
         "--store", str(tmp_path / "store"), "--out", str(out), "--allow-weak-scorer",
         "--capability-task", "tiny_choice", "--capability-task-dir", str(tasks)],
        capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    cells = steered_cells(doc)
    assert cells and [(r["concept"], r["strategy"], r["layer"], r["alpha"]) for r in doc["capability"]] == cells
    (stamped,) = out.glob("results_*.json")
    assert json.loads(stamped.read_text())["capability"] == doc["capability"]
    assert json.loads((out / "capability.json").read_text()) == doc["capability"]
    record = doc["capability"][0]
    zero = hand_accuracy(tiny_llama_dir, None, layer=record["layer"])
    assert record["n_docs"] == len(DOCS) and record["score_unsteered"] == pytest.approx(zero.mean())
    assert record["difference"] == pytest.approx(record["score_steered"] - record["score_unsteered"])
    assert record["ci_low"] <= record["difference"] <= record["ci_high"]
    assert np.isfinite([record["ci_low"], record["ci_high"]]).all()
    sentence = (f"tiny_choice acc steered by frustration/A1_mean L{record['layer']} at α {record['alpha']:g}: "
                f"{record['score_steered']:.3f} against {record['score_unsteered']:.3f} unsteered")
    answer = json.loads((out / "answer.json").read_text())
    assert any(s.startswith(sentence) for s in answer["sections"][-1]["sentences"])
    assert sentence in proc.stdout  # the printed answer and the stage's own line
    docs = tmp_path / "docs"
    for command in (["findings", "--run", str(out), "--out", str(docs)], ["report", "--run", str(out)]):
        done = subprocess.run([*DRIVER, *command], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    assert sentence in (docs / "findings.md").read_text()
    assert sentence in (out / "report.html").read_text()
