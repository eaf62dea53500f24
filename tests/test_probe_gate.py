"""ProbeGate: on CPU the probe jobs wait for the last pooling job and then leave in the order they came, and the
run's extractors are let go at that moment; beside the pooling (GPU, or --overlap) they pass at once."""

from __future__ import annotations

import pytest

from poolbench.config import RunConfig
from poolbench.driver.extractor_fleet import PROBES_PER_GPU_ENV
from poolbench.driver.probe_gate import ProbeGate, beside_the_forward, probes_beside


def test_held_jobs_leave_in_order_when_the_last_pooling_job_is_done():
    released: list[int] = []
    gate = ProbeGate[str](beside=False, on_pooled=lambda: released.append(len(released)))
    assert gate.start(3, ["stored-a", "stored-b"]) == []  # concepts pooled by an earlier run wait too
    assert gate.pooled(["c1"]) == []
    assert gate.pooled([]) == []  # a job whose concepts were all probed before
    assert released == []
    assert gate.pooled(["c3-l0", "c3-l1"]) == ["stored-a", "stored-b", "c1", "c3-l0", "c3-l1"]
    assert gate.held == [] and released == [0]


def test_with_nothing_to_pool_or_beside_the_pooling_every_job_passes_at_once():
    released: list[str] = []
    idle = ProbeGate[str](beside=False, on_pooled=lambda: released.append("idle"))
    assert idle.start(0, ["a", "b"]) == ["a", "b"]  # every concept was pooled before: a resumed run probes at once
    assert released == ["idle"]
    beside = ProbeGate[str](beside=True, on_pooled=lambda: released.append("beside"))
    assert beside.start(2, ["a"]) == ["a"]
    assert beside.pooled(["b"]) == ["b"] and released == ["idle"]  # the extractors stay while pooling is left
    assert beside.pooled(["c"]) == ["c"] and beside.held == [] and released == ["idle", "beside"]


@pytest.mark.parametrize(("overlap", "on_gpu", "beside"), [
    (None, False, False), (None, True, True), (True, False, True), (False, True, False)])
def test_probes_run_beside_the_pooling_where_the_forward_leaves_the_cores_free(overlap, on_gpu, beside):
    assert beside_the_forward(RunConfig(model="tiny", overlap=overlap), on_gpu) is beside


@pytest.mark.parametrize(("overlap", "on_gpu", "beside"), [
    (None, False, False), (None, True, False), (True, False, True), (False, True, False)])
def test_none_beside_an_extractor_holds_a_gpu_runs_probes_until_the_pooling_is_done(monkeypatch, overlap, on_gpu,
                                                                                     beside):
    """$POOLBENCH_PROBES_PER_GPU=0 (the A/B of probes beside the forward on a GPU): a GPU run's probes wait for the
    pooling as a CPU run's do; a CPU run told --overlap keeps them beside (its knob is the overlap); the parse
    tasks' rule (beside_the_forward) does not move."""
    cfg = RunConfig(model="tiny", overlap=overlap)
    monkeypatch.setenv(PROBES_PER_GPU_ENV, "0")
    assert probes_beside(cfg, on_gpu) is beside
    assert beside_the_forward(cfg, on_gpu) is (overlap if overlap is not None else on_gpu)
    monkeypatch.setenv(PROBES_PER_GPU_ENV, "2")
    assert probes_beside(cfg, on_gpu) is beside_the_forward(cfg, on_gpu)
