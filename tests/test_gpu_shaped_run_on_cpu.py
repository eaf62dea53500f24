"""The driver's GPU-shaped path on a CPU: a local Ray that reports one GPU (Ray counts it; torch sees none), so a
run at `--device auto` takes the GPU plan (an extractor holding two pooling jobs at once, its forwards on the
compute thread and each job's writes on the calling Ray thread, probe tasks with GPU shares) while every tensor
stays on the CPU. Its records must be the CPU plan's, bit for bit: the plan changes where work runs, not what."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from ray_cluster import reported_gpus_ray

from poolbench.config import RunConfig
from poolbench.driver.extractor_fleet import EXTRACTOR_GPU_SHARE, plan_workers
from poolbench.driver.pipeline import run_benchmark
from poolbench.records.events import RunEvent


@pytest.fixture(scope="module")
def ray_with_a_gpu():
    with reported_gpus_ray(num_cpus=2, num_gpus=1):
        yield


def run(model: Path, store: Path, device: str) -> tuple:
    events: list[RunEvent] = []
    cfg = RunConfig(model=str(model), corpus="embedded-v1", corpus_size="tiny", concepts=("hedging", "toxicity"),
                    strategies=("A1_mean", "P1_last", "S3_iti_probe"), store=str(store), n_bootstrap=50,
                    torch_threads=1, steering=False, device=device, concept_group_tokens=0)
    return run_benchmark(cfg, events.append), events


def test_the_gpu_plan_with_two_jobs_an_extractor_gives_the_cpu_plans_records(tiny_llama_dir, ray_with_a_gpu,
                                                                              cache, tmp_path):
    assert ray.cluster_resources().get("GPU") == 1.0
    # the plan `--device auto` gets here: one extractor on a GPU share (so its queue sends it two jobs)
    assert plan_workers(RunConfig(device="auto"), 2) == (1, {"num_gpus": EXTRACTOR_GPU_SHARE, "num_cpus": 1}, None)
    assert plan_workers(RunConfig(device="cpu"), 2)[1] == {"num_cpus": 1}
    on_cpu, _ = run(tiny_llama_dir, tmp_path / "cpu", "cpu")
    gpu_shaped, _ = run(tiny_llama_dir, tmp_path / "gpu", "auto")
    assert gpu_shaped.computed == on_cpu.computed == {"pooled": 2, "d1": 2, "pooled_skipped": 0, "d1_skipped": 0}
    assert [r.to_dict() for r in gpu_shaped.records] == [r.to_dict() for r in on_cpu.records]
    assert len(on_cpu.records) == 2 * 2 * 3 * 2
