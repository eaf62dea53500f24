"""D1's batched probe tasks share the extractor's GPU: the shares Ray counts must leave room for them beside one
extractor and never let Ray pack two extractors onto one GPU (fractional requests fill the first GPU that fits)."""

from __future__ import annotations

from poolbench.driver.extractor_fleet import EXTRACTOR_GPU_SHARE, PROBE_GPU_SHARE
from poolbench.driver.pipeline import probe_task_resources


def test_probe_tasks_take_a_gpu_share_only_on_a_gpu_run():
    assert probe_task_resources(False) == {"num_cpus": 1}  # Ray hides CUDA from it: the fits run on a host core
    assert probe_task_resources(True) == {"num_cpus": 1, "num_gpus": PROBE_GPU_SHARE}


def test_four_probes_fit_beside_one_extractor_and_two_extractors_never_share_a_gpu():
    assert EXTRACTOR_GPU_SHARE + 4 * PROBE_GPU_SHARE <= 1.0
    assert 2 * EXTRACTOR_GPU_SHARE > 1.0
