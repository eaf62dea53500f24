"""A D1 probe task runs on the GPU Ray gave it: CUDA binds a process to the GPU its first task saw, so where a node
has several GPUs each probe process runs one task (driver/probe_tasks.py); where every node has one, processes are
reused. Checked with a local Ray that reports two GPUs (Ray counts them and sets CUDA_VISIBLE_DEVICES per task;
torch sees none, the tensors stay on the CPU), through a real run's LayerProbed events."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from negation_pairs import passages
from ray_cluster import reported_gpus_ray

from poolbench.config import ProbingOptions, RunConfig
from poolbench.driver.nodes import Node
from poolbench.driver.pipeline import run_benchmark
from poolbench.driver.probe_tasks import probe_task_function, reuses_probe_processes
from poolbench.pooler.worker import ExtractorWorker
from poolbench.prober.concept_probe import probe_layer_task
from poolbench.records.events import LayerProbed, RunEvent
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import LocalStore


def node(gpus: float, alive: bool = True) -> Node:
    return Node("id", "127.0.0.1:1", alive, {"CPU": 8.0, **({"GPU": gpus} if gpus else {})})


def test_probe_processes_are_reused_only_where_no_node_has_two_gpus() -> None:
    assert reuses_probe_processes(False, [node(8)])  # a CPU run asks for no GPU: its processes are reused
    assert reuses_probe_processes(True, [node(1), node(1), node(0)])
    assert not reuses_probe_processes(True, [node(1), node(2)])
    assert reuses_probe_processes(True, [node(1), node(4, alive=False)])  # a dead node runs nothing
    assert probe_task_function(False)._default_options["max_calls"] == 1
    assert "max_calls" not in probe_task_function(True)._default_options  # Ray's default for a CPU function: reuse


@pytest.fixture
def ray_with_two_gpus():
    with reported_gpus_ray(num_cpus=4, num_gpus=2):
        yield


CONCEPTS = ("hedging", "toxicity", "negation_density")


def test_probe_tasks_with_gpu_shares_on_a_two_gpu_node_each_run_in_a_process_of_their_own(
        tiny_llama_dir: Path, ray_with_two_gpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run whose pipeline is told (as on a node with two GPUs) not to reuse probe processes: each of its six
    layer tasks pays its own process; then the same tasks with the GPU share a GPU run asks for, on a fresh Ray:
    each sees the one GPU Ray gave it, and writes the run's records."""
    asked: list[tuple] = []

    def one_task_a_process(on_gpu, nodes):
        asked.append((on_gpu, list(nodes)))
        return False

    monkeypatch.setattr("poolbench.driver.pipeline.reuses_probe_processes", one_task_a_process)
    store_url = str(tmp_path / "store")
    events: list[RunEvent] = []
    cfg = RunConfig(model=str(tiny_llama_dir), corpus="embedded-v1", corpus_size="tiny", concepts=CONCEPTS,
                    strategies=("A1_mean", "P1_last"), store=store_url, n_bootstrap=50, torch_threads=1,
                    steering=False, device="auto", concept_group_tokens=0)
    outcome = run_benchmark(cfg, events.append)
    assert outcome.computed["d1"] == 3
    [(on_gpu, nodes)] = asked
    assert not on_gpu and reuses_probe_processes(on_gpu, nodes)  # torch sees no GPU here: a CPU plan would reuse
    probed = [e for e in events if isinstance(e, LayerProbed)]
    assert len(probed) == 3 * 2  # concepts x the tiny model's two probed layers
    # Each task paid its own process's start: no process ran a second (reused, the six tasks on the two cores the
    # extractors leave would share processes); from submission to result, at least the task's own seconds.
    assert [e.earlier_tasks for e in probed] == [0] * 6
    assert len({e.pid for e in probed}) == 6 and os.getpid() not in {e.pid for e in probed}
    assert all(e.wall_s >= e.read_s + e.probe_s + e.write_s > 0 for e in probed)
    assert {e.devices for e in probed} == {""}  # CPU tasks: Ray leaves CUDA_VISIBLE_DEVICES alone

    with reported_gpus_ray(num_cpus=4, num_gpus=2):  # a fresh pool of worker processes for the GPU-share tasks
        shards = str(tmp_path / "shards")
        worker = ExtractorWorker(str(tiny_llama_dir))
        worker.pool_concept("negation", passages(12, "train") + passages(6, "test"), [0, 1], ["A1_mean", "P1_last"],
                            store_url=shards, key="pooled/k", metadata={"concept": "negation"}, batch_size=8,
                            max_length=64)
        probing = ProbingOptions(n_folds=3, seed=0, n_bootstrap=20, reliability=False)
        task = probe_task_function(reuse_processes=False)
        refs = [task.options(num_cpus=1, num_gpus=0.5).remote(shards, "pooled/k", f"d1/{k}", "negation", layer, probing)
                for k in range(3) for layer in (0, 1)]
        results = ray.get(refs)
        assert [r["earlier_tasks"] for r in results] == [0] * 6 and len({r["pid"] for r in results}) == 6
        assert {r["devices"] for r in results} <= {"0", "1"} and all(r["devices"] for r in results)
        # where the task ran changes nothing it wrote: each copy's records are those of the same task without a GPU
        # share (every Ray worker here computes on one thread: the fixture's OMP_NUM_THREADS)
        reference = ray.get([ray.remote(probe_layer_task).options(num_cpus=1).remote(
            shards, "pooled/k", "d1/cpu", "negation", layer, probing) for layer in (0, 1)])
        store = LocalStore(tmp_path / "shards")
        for layer, done in zip((0, 1), reference, strict=True):
            expected = store.get_table(done["key"])
            assert expected.num_rows == 2 * 2  # the two strategies' cells, a diffmean and a logistic probe each
            for k in range(3):
                assert store.get_table(layer_shard_key(f"d1/{k}", layer)).equals(expected)
