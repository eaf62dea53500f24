"""What steering costs: lm-evaluation-harness's local-completions model scores a task read from local JSON files,
offline, through the live Serve app's /v1/completions, unsteered and steered by the run's stored vector; the paired
difference and its bootstrap interval (hand-computed cases, and should-fail ones)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from planted_run import PLANTED, store_planted_table
from tiny_models import save_tiny_llama

from poolbench.capability.measure import CapabilityError, paired_difference

# Single-letter choices: near-equal likelihoods on the random tiny model, so steering can reorder them.
DOCS = [{"question": q, "choices": ["a", "e", "o", "s"], "label": y} for q, y in [
    ("the cat sat on the", 0), ("birds sang in the", 1), ("water boils at one hundred", 2), ("the door is", 3),
    ("she owns two", 0), ("near the park the", 1), ("it could possibly rain", 2), ("we leave at", 3)]]


def test_paired_difference_by_hand():
    assert paired_difference(np.array([1.0, 1, 0, 1]), np.array([0.0, 1, 0, 0]))[0] == 0.5
    assert paired_difference(np.ones(5), np.ones(5)) == (0.0, 0.0, 0.0)  # no document moved: no interval
    diff, low, high = paired_difference(np.array([1.0, 1, 0, 1]), np.array([0.0, 1, 0, 0]), n_bootstrap=500)
    assert 0.0 <= low <= diff <= high <= 1.0  # resampled means of (1, 0, 0, 1) lie in [0, 1]


def test_paired_difference_should_separate_a_real_cost_and_not_a_null_one():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, 60).astype(float)
    worse = np.where(rng.random(60) < 0.5, 0.0, base)  # steering loses about half of what was right
    _, _, high = paired_difference(worse, base, seed=1)
    assert high < 0  # a real cost: the interval excludes 0
    shuffled = rng.permutation(base)  # the same accuracy, unrelated per document
    _, low, high = paired_difference(shuffled, base, seed=1)
    assert low < 0 < high
    with pytest.raises(CapabilityError, match="need the same >= 2 docs"):
        paired_difference(np.ones(3), np.ones(4))


@pytest.fixture(scope="module")
def run_and_task(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A run folder (the tiny Llama, its pooled table with train DiffMean = PLANTED at layer 1, a D2 cell there with
    residual norm 6 and alpha* 4) and a task folder: a YAML over a local JSONL file, nothing from the hub."""
    root = tmp_path_factory.mktemp("capability")
    model = save_tiny_llama(root / "llama", weight_std=0.2)
    store_planted_table(root / "store")
    (root / "run").mkdir()
    (root / "run" / "results.json").write_text(json.dumps({
        "config": {"store": str(root / "store"), "model": str(model)},
        "artifacts": {"praise": {"pooled": "pooled/praise"}},
        "d2": [{"concept": "praise", "strategy": "A1_mean", "layer": 1, "residual_norm": 6.0, "alpha_star": 4.0}]}))
    (root / "task").mkdir()
    (root / "task" / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "task" / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'task' / 'docs.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: question\ndoc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    return root / "run", model, root / "task"


def hand_accuracy(model_dir: Path, delta: np.ndarray | None, layer: int = 1) -> np.ndarray:
    """Each doc's acc as lm-eval defines it, computed here: the choice whose ' choice' tokens (context tokens, then
    the rest of context + ' ' + choice, no special tokens) have the highest summed log-probability, with `delta`
    added to block `layer`'s output."""
    from poolbench.extractor.loading import load_model

    m = load_model(str(model_dir), device="cpu")
    tok = m.tokenizer
    hook = None
    if delta is not None:
        added = torch.as_tensor(delta, dtype=torch.float32)
        hook = m.decoder_layers[layer].register_forward_hook(
            lambda _m, _i, out: (out[0] + added, *out[1:]) if isinstance(out, tuple) else out + added)
    try:
        acc = []
        for doc in DOCS:
            ctx = tok.encode(doc["question"], add_special_tokens=False)
            sums = []
            for choice in doc["choices"]:
                whole = tok.encode(doc["question"] + " " + choice, add_special_tokens=False)
                with torch.no_grad():
                    logp = torch.log_softmax(m.model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
                sums.append(sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole))))
            acc.append(float(int(np.argmax(sums)) == doc["label"]))
        return np.array(acc)
    finally:
        if hook is not None:
            hook.remove()


def test_capability_command_runs_lm_eval_offline_through_the_endpoint_at_alpha_star_and_zero(run_and_task,
                                                                                               monkeypatch, local_ray):
    from typer.testing import CliRunner

    from poolbench.cli.app import app

    run, model, task_dir = run_and_task
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["capability", "--run", str(run), "--task", "tiny_choice", "--task-dir",
                                      str(task_dir), "--concept", "praise", "--strategy", "A1", "--n-bootstrap",
                                      "200"])
    assert result.exit_code == 0, result.output
    (record,) = json.loads((run / "capability.json").read_text())
    zero = hand_accuracy(model, None)
    steered = hand_accuracy(model, 4.0 * 6.0 * PLANTED / np.linalg.norm(PLANTED))  # alpha* x residual norm x unit
    assert (steered != zero).any()  # steering changes answers, so lm-eval's steered arm is checked
    assert record["n_docs"] == len(DOCS) and record["alpha"] == 4.0 and record["layer"] == 1
    assert record["score_unsteered"] == pytest.approx(zero.mean())
    assert record["score_steered"] == pytest.approx(steered.mean())
    assert record["difference"] == pytest.approx(steered.mean() - zero.mean())
    assert record["ci_low"] <= record["difference"] <= record["ci_high"]
    assert json.loads((run / "results.json").read_text())["capability"] == [record]  # where findings reads it
