"""A steering engine that died for good (EngineDied: the vLLM backend's second death) ends the steering stage, not
the run: D1 is written with an `errors` record naming the cause, and the CLI/API stop with one line.

The engine's death itself is real in tests/test_vllm_live.py; here it is raised where the driver's steering stage
would raise it (what WorkQueue re-raises from the actor), so the run around it is what is under test."""

from __future__ import annotations

import json

import pytest

from poolbench import api
from poolbench.driver import steering_stage
from poolbench.errors import StageFailed
from poolbench.steerer.errors import EngineDied

CAUSE = "vLLM engine died: RuntimeError: Worker failed with error 'CPU Generator does not use offset'"


def test_a_dead_engine_fails_steering_and_keeps_d1(tiny_llama_dir, local_ray, cache, tmp_path, monkeypatch):
    steered = []

    def dies(*args, **kwargs):
        steered.append(True)
        raise EngineDied(CAUSE)

    monkeypatch.setattr(steering_stage, "steer", dies)  # pipeline imports it when it steers
    out = tmp_path / "run"
    with pytest.raises(StageFailed) as err:
        api.evaluate(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny", concepts=["hedging"],
                     strategies=["A1_mean", "P1_last"], store=str(tmp_path / "store"), n_bootstrap=50,
                     torch_threads=1, reliability=False, out=out)
    assert steered == [True]
    assert str(err.value) == f"steering failed: {CAUSE} (the D1 results are in {out / 'results.json'})"
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == [{"stage": "steering", "message": CAUSE}]
    assert {c["strategy"] for c in results["cells"]} == {"A1_mean", "P1_last"} and "d2" not in results
    assert json.loads((out / "leaderboard.json").read_text())["strategies"]
