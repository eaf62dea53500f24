"""D1's batched probe tasks share the extractor's GPU: the shares Ray counts must leave room for them beside one
extractor and never let Ray pack two extractors onto one GPU (fractional requests fill the first GPU that fits)."""

from __future__ import annotations

from poolbench.driver.extractor_fleet import EXTRACTOR_GPU_SHARE, PROBE_GPU_SHARE
from poolbench.driver.probe_tasks import probe_task_resources


def test_probe_tasks_take_a_gpu_share_only_on_a_gpu_run():
    assert probe_task_resources(False) == {"num_cpus": 1}  # Ray hides CUDA from it: the fits run on a host core
    assert probe_task_resources(True) == {"num_cpus": 1, "num_gpus": PROBE_GPU_SHARE}


def test_two_probes_fit_beside_one_extractor_eight_alone_and_two_extractors_never_share_a_gpu():
    assert EXTRACTOR_GPU_SHARE + 2 * PROBE_GPU_SHARE <= 1.0 < EXTRACTOR_GPU_SHARE + 3 * PROBE_GPU_SHARE
    assert 1.0 / PROBE_GPU_SHARE == 8  # a layer's batched cells take ~6 GB a task (extractor_fleet's comment)
    assert 2 * EXTRACTOR_GPU_SHARE > 1.0


def test_the_probes_per_gpu_knob_divides_the_room_beside_the_extractor(monkeypatch):
    import pytest

    from poolbench.driver.extractor_fleet import PROBES_PER_GPU_ENV
    from poolbench.errors import PoolBenchError

    monkeypatch.setenv(PROBES_PER_GPU_ENV, "1")
    assert probe_task_resources(True) == {"num_cpus": 1, "num_gpus": 0.25}  # one probe beside the extractor
    monkeypatch.setenv(PROBES_PER_GPU_ENV, "2")
    assert probe_task_resources(True)["num_gpus"] == 0.125
    assert probe_task_resources(False) == {"num_cpus": 1}  # a CPU run asks for no GPU whatever it says
    monkeypatch.setenv(PROBES_PER_GPU_ENV, "0")  # none beside: they wait for the pooling, then 8 share the GPU
    assert probe_task_resources(True)["num_gpus"] == PROBE_GPU_SHARE
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(PROBES_PER_GPU_ENV, bad)
        with pytest.raises(PoolBenchError, match=f"{PROBES_PER_GPU_ENV}='{bad}'"):
            probe_task_resources(True)
    monkeypatch.setenv(PROBES_PER_GPU_ENV, "")
    assert probe_task_resources(True)["num_gpus"] == PROBE_GPU_SHARE
