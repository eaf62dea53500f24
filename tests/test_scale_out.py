"""Scale-out on loopback: a Ray cluster of a head and two worker nodes (ray.cluster_utils.Cluster, all on 127.0.0.1),
the store on a moto S3 server run as a process. A node removed without grace mid-pool costs time, never cells; nodes
declaring GPUs get one extractor and one steering engine per GPU and split the work; a lost steering actor's cells
run again elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray_cluster import add_loopback_node, loopback_cluster, node_name
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer
from slow_strategy import write_slow_mean

from poolbench.config import RunConfig
from poolbench.driver.pipeline import run_benchmark
from poolbench.errors import PoolBenchError
from poolbench.pooler.registry import unregister_strategy
from poolbench.records.events import ConceptPooled, JobRetried, RunEvent, RunPlanned, SteeringStarted

CONCEPTS = ("hedging", "toxicity", "contrast", "causation")


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto server of the test's own and the variables the driver forwards to every worker; yields a bucket."""
    server = MotoServer()
    server.start()
    try:
        for key, value in {"POOLBENCH_S3_ENDPOINT": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}.items():
            monkeypatch.setenv(key, value)
        yield server.make_bucket("poolbench-scale-out")
    finally:
        server.stop()


def config(model: Path, store: str, **overrides) -> RunConfig:
    base = dict(model=str(model), corpus_size="tiny", concepts=CONCEPTS, strategies=("A1_mean", "P1_last"),
                layers=(1,), store=store, n_bootstrap=100, torch_threads=1, reliability=False, steering=False,
                concept_group_tokens=0)
    return RunConfig(**{**base, **overrides})


def test_a_node_removed_mid_pool_costs_time_not_cells(tiny_llama_dir, cache, s3_env, monkeypatch, tmp_path):
    """One extractor per CPU node (SPREAD); when the first concept is pooled the node of the other, busy, extractor
    is removed without grace: its job runs again on the surviving node and the cells equal an undisturbed run's."""
    with loopback_cluster({"num_cpus": 2}, {"num_cpus": 2}) as (cluster, workers):
        address = cluster.address
        calm_events: list[RunEvent] = []
        plugin = write_slow_mean(tmp_path, "X8_slow_mean", 1.0)  # the removed node's job is still running
        slow = {"strategies": ("A1_mean", "X8_slow_mean")}
        calm = run_benchmark(config(tiny_llama_dir, f"s3://{s3_env}/calm", address=address, **slow),
                             calm_events.append, strategy_modules=(str(plugin),))
        [planned] = [e for e in calm_events if isinstance(e, RunPlanned)]
        assert planned.workers == 2  # one per node with a core to spare: the head holds no CPU
        assert set(calm.cluster.jobs_by_node["pool"]) == {node_name(w) for w in workers}  # the work split
        assert calm.cluster.retried == () and calm.cluster.lost_nodes == ()

        removed: list[str] = []
        retried: list[JobRetried] = []
        by_name = {node_name(w): w for w in workers}

        def on_event(event: RunEvent) -> None:
            if isinstance(event, ConceptPooled) and not removed:
                # The queue hands a freed extractor its next job before it reports the concept (two of four are
                # still waiting), so the node that pooled this concept holds a job now: it is lost with the node.
                removed.append(event.node)
                cluster.remove_node(by_name[event.node], allow_graceful=False)
            elif isinstance(event, JobRetried):
                retried.append(event)

        try:
            stormy = run_benchmark(config(tiny_llama_dir, f"s3://{s3_env}/stormy", address=address, **slow), on_event,
                                   strategy_modules=(str(plugin),))
        finally:
            unregister_strategy("X8_slow_mean")
    assert stormy.records == calm.records and {r.concept for r in stormy.records} == set(CONCEPTS)
    assert stormy.computed == calm.computed == {"pooled": len(CONCEPTS), "d1": len(CONCEPTS), "pooled_skipped": 0,
                                                "d1_skipped": 0}
    pool_retries = [r for r in retried if r.job.startswith("pool ")]
    [survivor] = set(by_name) - set(removed)
    assert pool_retries and all(r.node == removed[0] and r.on == survivor for r in pool_retries)
    assert list(stormy.cluster.retried) == retried
    assert stormy.cluster.lost_nodes == (removed[0],)
    assert ray.is_initialized() is False


@pytest.mark.slow
def test_with_no_node_left_the_run_stops_in_one_line_and_a_rerun_resumes(tiny_llama_dir, cache, s3_env):
    """The one CPU node is removed once the first concept is pooled: no alive node can hold an extractor, so the
    run stops in one line naming the lost node; with a new node the same command pools only what is missing."""
    cfg_store = f"s3://{s3_env}/alone"
    with loopback_cluster({"num_cpus": 2}) as (cluster, [node]):
        cfg = config(tiny_llama_dir, cfg_store, address=cluster.address)
        pooled: list[str] = []

        def remove_the_node(event: RunEvent) -> None:
            if isinstance(event, ConceptPooled) and not pooled:
                pooled.append(event.concept)
                cluster.remove_node(node, allow_graceful=False)

        with pytest.raises(PoolBenchError) as stopped:
            run_benchmark(cfg, remove_the_node)
        message = str(stopped.value)
        assert len(message.splitlines()) == 1
        assert message.startswith("no node with 1 CPU is left in the Ray cluster") and node_name(node) in message
        add_loopback_node(cluster, num_cpus=2)
        cluster.wait_for_nodes()
        resumed = run_benchmark(cfg)
    assert resumed.computed["pooled_skipped"] == len(pooled) == 1
    assert resumed.computed["pooled"] == len(CONCEPTS) - 1
    assert {r.concept for r in resumed.records} == set(CONCEPTS)


def test_a_local_folder_store_on_a_multi_node_cluster_is_refused_in_one_line(tiny_llama_dir, cache, tmp_path):
    with loopback_cluster({"num_cpus": 1}, head_cpus=1) as (cluster, _), pytest.raises(PoolBenchError) as refused:
        run_benchmark(config(tiny_llama_dir, str(tmp_path / "store"), address=cluster.address))
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "2 nodes" in message and "s3://" in message
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]  # nothing stored


STEERING_CONCEPTS = ("imdb_sentiment", "frustration")  # two default steering concepts, each the other's neighbour


def test_gpu_nodes_get_an_extractor_and_an_engine_each_and_a_lost_engine_costs_no_cells(tiny_llama_dir, cache,
                                                                                          s3_env):
    """Nodes that declare one GPU each (a CPU device underneath): one extractor per GPU, the concepts' pooling
    split across both nodes, one steering engine per GPU node; the first engine is SIGKILLed once both are loaded,
    so the group of cells sent to it runs again on the engine of the other node, and every chosen cell is steered."""
    import os
    import signal

    with loopback_cluster({"num_cpus": 2, "num_gpus": 1}, {"num_cpus": 2, "num_gpus": 1}) as (cluster, workers):
        events: list[RunEvent] = []
        killed: list[int] = []

        def on_event(event: RunEvent) -> None:
            events.append(event)
            if isinstance(event, SteeringStarted):
                assert set(event.nodes) == {node_name(w) for w in workers}  # one engine per GPU node
                killed.append(event.worker_pids[0])
                os.kill(event.worker_pids[0], signal.SIGKILL)

        outcome = run_benchmark(config(tiny_llama_dir, f"s3://{s3_env}/gpus", address=cluster.address,
                                       concepts=STEERING_CONCEPTS, steering=True, allow_weak_scorer=True),
                                on_event)
    nodes = {node_name(w) for w in workers}
    [planned] = [e for e in events if isinstance(e, RunPlanned)]
    assert planned.workers == 2  # one extractor per GPU
    assert set(outcome.cluster.jobs_by_node["pool"]) == nodes  # one concept on each GPU node
    assert killed
    [retry] = [r for r in outcome.cluster.retried if r.job.startswith("steer ")]
    # the process died, its node lives ("unreachable" while Ray has not yet noticed the death)
    assert retry.how in ("died", "unreachable") and {retry.node, retry.on} == nodes
    assert outcome.steering is not None
    d2 = outcome.steering["d2"]
    assert sorted(r.concept for r in d2) == sorted(STEERING_CONCEPTS * 2)  # best and worst cell of each concept
    assert all(r.status == "ok" for r in d2)
    assert outcome.cluster.lost_nodes == ()  # a process died; both nodes lived
