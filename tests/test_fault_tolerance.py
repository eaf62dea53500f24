"""A run survives a killed worker, a killed driver resumes without recomputing, a lost S3 server is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

from poolbench.config import RunConfig
from poolbench.driver.pipeline import run_benchmark
from poolbench.errors import StoreError
from poolbench.records.events import ConceptPooled, RunEvent, RunPlanned
from poolbench.store.artifact_store import SIDECAR_SUFFIX
from poolbench.store.keys import layer_shard_key
from poolbench.store.url import open_store

CONCEPTS = ("hedging", "toxicity", "contrast")
MANY = ("hedging", "toxicity", "contrast", "causation", "planning", "narrative", "deference", "depression",
        "frustration", "code_docs", "bureaucratic", "academic_tone")


def config(model: Path, store: str, **overrides) -> RunConfig:
    base = dict(model=str(model), corpus_size="tiny", concepts=CONCEPTS, strategies=("A1_mean", "P1_last"),
                store=store, n_bootstrap=100, torch_threads=1, reliability=False,
                steering=False)
    return RunConfig(**{**base, **overrides})


@pytest.fixture
def cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.getbasetemp() / "poolbench-cache"
    monkeypatch.setenv("POOLBENCH_CACHE", str(root))
    return root


def test_killed_worker_is_restarted_and_the_run_matches_an_undisturbed_one(tiny_llama_dir, local_ray, cache,
                                                                           tmp_path):
    calm = run_benchmark(config(tiny_llama_dir, str(tmp_path / "calm")))
    pids: list[int] = []
    killed: list[int] = []

    def on_event(event: RunEvent) -> None:
        if isinstance(event, RunPlanned):
            pids.extend(event.worker_pids)
        elif isinstance(event, ConceptPooled) and not killed:  # the worker is busy with the next concept now
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    stormy = run_benchmark(config(tiny_llama_dir, str(tmp_path / "stormy")), on_event)
    assert killed
    assert stormy.computed["pooled"] == len(CONCEPTS)
    assert stormy.records == calm.records
    store = open_store(str(tmp_path / "stormy"))
    for kind in ("pooled", "d1"):  # each concept's artifact and one shard per layer, nothing else
        assert sorted(store.list(kind)) == sorted(key for a in stormy.artifacts.values() for key in
                                                  (a[kind], *(layer_shard_key(a[kind], L) for L in stormy.layers)))


def pooled_concepts(store_dir: Path) -> int:
    """Concepts marked pooled: their manifests, written under the concept key after every layer shard."""
    return len([p for p in (store_dir / "pooled").glob("*.json") if not p.name.endswith(SIDECAR_SUFFIX)])


def test_killed_driver_resumes_without_recomputing(tiny_llama_dir, cache, tmp_path):
    store_dir = tmp_path / "store"
    args = [sys.executable, "-c", "from poolbench.cli.app import main; main()", "run", "--model", str(tiny_llama_dir),
            "--corpus-size", "tiny", "--concepts", ",".join(MANY), "--strategies", "A1_mean,P1_last",
            "--store", str(store_dir), "--bootstrap", "100", "--no-reliability", "--no-steering",
            "--torch-threads", "1", "--out", str(tmp_path / "out")]
    env = {**os.environ, "POOLBENCH_CACHE": str(cache)}
    driver = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not pooled_concepts(store_dir):
        time.sleep(0.01)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray it started
    driver.wait(timeout=30)
    # A Ray worker notices its dead raylet only after it finishes the write it is in: count once nothing changes.
    done_before, stable_since = -1, time.monotonic()
    while time.monotonic() - stable_since < 3.0:
        now = pooled_concepts(store_dir)
        if now != done_before:
            done_before, stable_since = now, time.monotonic()
        time.sleep(0.2)
    assert 1 <= done_before < len(MANY)
    assert not (tmp_path / "out" / "results.json").exists()

    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    computed = json.loads((tmp_path / "out" / "results.json").read_text())["computed"]
    assert computed["pooled_skipped"] == done_before
    assert computed["pooled"] == len(MANY) - done_before


def test_s3_outage_is_one_line_and_a_rerun_completes(tiny_llama_dir, local_ray, cache, tmp_path, monkeypatch):
    server = MotoServer()
    server.start()
    try:
        bucket = server.make_bucket("poolbench-outage")
        for key, value in {"POOLBENCH_S3_ENDPOINT": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}.items():
            monkeypatch.setenv(key, value)
        cfg = config(tiny_llama_dir, f"s3://{bucket}/run", concepts=("hedging",))

        def stop_mid_run(event: RunEvent) -> None:
            if isinstance(event, RunPlanned):  # workers are up and hold the model; nothing is stored yet
                server.stop()

        with pytest.raises(StoreError) as lost:
            run_benchmark(cfg, stop_mid_run)
        message = str(lost.value).strip()
        assert len(message.splitlines()) == 1 and server.endpoint in message
        server.start()  # moto keeps nothing across restarts: the bucket must be made again
        server.make_bucket(bucket)
        outcome = run_benchmark(cfg)
        assert outcome.computed["pooled"] == 1 and outcome.computed["d1"] == 1
    finally:
        server.stop()
