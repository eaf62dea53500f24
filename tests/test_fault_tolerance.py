"""A run survives a killed worker, a killed driver resumes without recomputing, a lost S3 server is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


HELD_PLUGIN = """
import os
import time
from pathlib import Path

import numpy as np

from poolbench.pooler.registry import register_strategy
from poolbench.pooler.spec import StrategySpec

HOOK = Path({hook!r})
CALLS = []


def held_mean(ctx):
    \"\"\"A1's weights. Armed, the second batch a worker process pools (so it is mid-task, part of the work
    done) announces the process and blocks until the test kills it; the restarted worker runs straight on.\"\"\"
    CALLS.append(len(ctx.passage_ids))
    with open(HOOK / "calls", "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    if len(CALLS) == 2 and (HOOK / "armed").exists() and not (HOOK / "busy").exists():
        (HOOK / "busy.tmp").write_text(str(os.getpid()))
        (HOOK / "busy.tmp").rename(HOOK / "busy")
        time.sleep(300)
    return np.ones(ctx.attention_mask.shape)


register_strategy(StrategySpec(id="X9_held_mean", code="X9", family="other", kind="weights",
                               weights_fn=held_mean, description="A1_mean that can hold a worker mid-task."))
"""


def comparable(outcome) -> dict:
    """results.json without what differs between two runs of the same cells: date, timing, the store's path."""
    from poolbench.results.document import results_document

    document = results_document(outcome)
    return {k: v for k, v in document.items() if k not in ("date", "timing", "config", "store")}


def test_worker_killed_mid_task_is_restarted_and_the_run_matches_an_undisturbed_one(tiny_llama_dir, local_ray,
                                                                                    cache, tmp_path):
    """SIGKILL the extractor while it is inside a batch of a concept: Ray restarts the actor, the work queue's
    pooling task is retried on it, and results.json equals an undisturbed run's."""
    from poolbench.pooler.registry import unregister_strategy

    hook = tmp_path / "hook"
    hook.mkdir()
    plugin = tmp_path / "held_strategy.py"
    plugin.write_text(HELD_PLUGIN.format(hook=str(hook)))
    strategies = ("A1_mean", "P1_last", "X9_held_mean")
    try:
        calm = run_benchmark(config(tiny_llama_dir, str(tmp_path / "calm"), strategies=strategies),
                             strategy_modules=(str(plugin),))
    finally:
        unregister_strategy("X9_held_mean")
    (hook / "calls").unlink()
    (hook / "armed").touch()
    pids: list[int] = []
    pooled_events: list[str] = []
    killed: list[int] = []
    stop = threading.Event()

    def kill_when_busy() -> None:
        while not stop.is_set() and not (hook / "busy").exists():
            time.sleep(0.02)
        if (hook / "busy").exists():
            pid = int((hook / "busy").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    def on_event(event: RunEvent) -> None:
        if isinstance(event, RunPlanned):
            pids.extend(event.worker_pids)
        elif isinstance(event, ConceptPooled):
            pooled_events.append(event.concept)

    watcher = threading.Thread(target=kill_when_busy, daemon=True)
    watcher.start()
    try:
        stormy = run_benchmark(config(tiny_llama_dir, str(tmp_path / "stormy"), strategies=strategies), on_event,
                               strategy_modules=(str(plugin),))
    finally:
        stop.set()
        watcher.join(timeout=10)
        unregister_strategy("X9_held_mean")
    assert killed == [pids[0]]  # the extractor itself, while it held a batch
    calls = [int(line) for line in (hook / "calls").read_text().split()]
    assert calls[:2] == [killed[0], killed[0]]  # one batch pooled, then killed inside the second
    restarted = set(calls[2:])
    assert len(restarted) == 1 and killed[0] not in restarted  # a new process, the restarted actor, went on
    assert sorted(pooled_events) == sorted(CONCEPTS)  # each concept pooled once: the killed task was retried
    assert stormy.computed == calm.computed == {"pooled": len(CONCEPTS), "d1": len(CONCEPTS), "pooled_skipped": 0,
                                                "d1_skipped": 0}
    assert stormy.records == calm.records
    assert comparable(stormy) == comparable(calm)
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
            "--store", str(store_dir), "--n-bootstrap", "100", "--no-reliability", "--no-steering",
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
