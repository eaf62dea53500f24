"""A run survives a killed worker, a killed driver resumes without recomputing, a lost S3 server is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

from poolbench.config import RunConfig
from poolbench.driver.pipeline import run_benchmark
from poolbench.errors import StoreError
from poolbench.records.events import ConceptPooled, RunEvent, RunPlanned
from poolbench.store.keys import layer_shard_key
from poolbench.store.local import SIDECAR_SUFFIX
from poolbench.store.url import open_store

CONCEPTS = ("hedging", "toxicity", "contrast")
MANY = ("hedging", "toxicity", "contrast", "causation", "planning", "narrative", "deference", "depression",
        "frustration", "code_docs", "bureaucratic", "academic_tone")


def config(model: Path, store: str, **overrides) -> RunConfig:
    base = dict(model=str(model), corpus_size="tiny", concepts=CONCEPTS, strategies=("A1_mean", "P1_last"),
                store=store, n_bootstrap=100, torch_threads=1, reliability=False,
                steering=False)
    return RunConfig(**{**base, **overrides})



HELD_PLUGIN = """
import os
import signal
from pathlib import Path

import numpy as np

from poolbench.pooler.registry import register_strategy
from poolbench.pooler.spec import StrategySpec

HOOK = Path({hook!r})
CALLS = []


def held_mean(ctx):
    \"\"\"A1's weights. Armed, the second batch a worker process pools (so it is mid-task, part of the work
    done) records the process and SIGKILLs it; the restarted worker runs straight on.\"\"\"
    CALLS.append(len(ctx.passage_ids))
    with open(HOOK / "calls", "a") as log:
        log.write(f"{{os.getpid()}}\\n")
    if len(CALLS) == 2 and (HOOK / "armed").exists() and not (HOOK / "killed").exists():
        (HOOK / "killed").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return np.ones(ctx.attention_mask.shape)


register_strategy(StrategySpec(id="X9_held_mean", code="X9", family="other", kind="weights",
                               weights_fn=held_mean, description="A1_mean that can kill its worker mid-task."))
"""


def comparable(outcome) -> dict:
    """results.json without what differs between two runs of the same cells: date, timing, the store's path, and
    the cluster section (which jobs ran where and which ran again)."""
    from poolbench.results.documents.document import results_document

    document = results_document(outcome)
    return {k: v for k, v in document.items() if k not in ("date", "timing", "config", "store", "cluster")}


@pytest.mark.parametrize("group_tokens", [None, 10**6], ids=["one-concept-jobs", "one-group-job"])
def test_worker_killed_mid_task_is_restarted_and_the_run_matches_an_undisturbed_one(tiny_llama_dir, local_ray,
                                                                                    cache, tmp_path, group_tokens):
    """SIGKILL the extractor while it is inside a batch of a concept (or of the one job pooling every concept in
    shared forwards): Ray restarts the actor, the work queue's pooling task is retried on it, and results.json
    equals an undisturbed run's."""
    from poolbench.pooler.registry import unregister_strategy

    hook = tmp_path / "hook"
    hook.mkdir()
    plugin = tmp_path / "held_strategy.py"
    plugin.write_text(HELD_PLUGIN.format(hook=str(hook)))
    strategies = ("A1_mean", "P1_last", "X9_held_mean")
    # a budget of 32 of the tiny corpus's 256-token passages (a CPU's default, 1,024 tokens, would cut 4-row forwards)
    grouping = {"concept_group_tokens": group_tokens, "max_batch_tokens": 32 * 256}
    try:
        calm = run_benchmark(config(tiny_llama_dir, str(tmp_path / "calm"), strategies=strategies, **grouping),
                             strategy_modules=(str(plugin),))
    finally:
        unregister_strategy("X9_held_mean")
    sizes = calm.corpus["passages"].values()  # one weights call per forward of 32 passages (the budget above)
    forwards = -(-sum(sizes) // 32) if group_tokens else sum(-(-n // 32) for n in sizes)
    assert len((hook / "calls").read_text().split()) == forwards
    (hook / "calls").unlink()
    (hook / "armed").touch()
    pids: list[int] = []
    pooled_events: list[str] = []
    def on_event(event: RunEvent) -> None:
        if isinstance(event, RunPlanned):
            pids.extend(event.worker_pids)
        elif isinstance(event, ConceptPooled):
            pooled_events.append(event.concept)

    try:
        stormy = run_benchmark(config(tiny_llama_dir, str(tmp_path / "stormy"), strategies=strategies, **grouping),
                               on_event, strategy_modules=(str(plugin),))
    finally:
        unregister_strategy("X9_held_mean")
    killed = [int((hook / "killed").read_text())]
    assert killed == [pids[0]]  # the extractor itself, while it held a batch
    calls = [int(line) for line in (hook / "calls").read_text().split()]
    assert calls[:2] == [killed[0], killed[0]]  # one batch pooled, then killed inside the second
    restarted = set(calls[2:])
    assert len(restarted) == 1 and killed[0] not in restarted  # a new process, the replacement actor, went on
    assert sorted(pooled_events) == sorted(CONCEPTS)  # each concept pooled once: the killed task was retried
    [retry] = stormy.cluster.retried  # the killed job, reported as run again on a replacement worker
    assert retry.how == "died" and retry.attempt == 2 and retry.job.startswith("pool ") and retry.on == retry.node
    assert calm.cluster.retried == () and stormy.cluster.lost_nodes == ()
    assert stormy.computed == calm.computed == {"pooled": len(CONCEPTS), "d1": len(CONCEPTS), "pooled_skipped": 0,
                                                "d1_skipped": 0}
    assert stormy.records == calm.records
    assert comparable(stormy) == comparable(calm)
    store = open_store(str(tmp_path / "stormy"))
    for kind in ("pooled", "d1"):  # each concept's artifact and one shard per layer, nothing else
        assert sorted(store.list(kind)) == sorted(key for a in stormy.artifacts.values() for key in
                                                  (a[kind], *(layer_shard_key(a[kind], L) for L in stormy.layers)))


KILL_PLUGIN = """
import os
import signal
from pathlib import Path

import numpy as np

from poolbench.pooler.registry import register_strategy
from poolbench.pooler.spec import StrategySpec

HOOK = Path({hook!r})
POOLED = Path({pooled!r})
AFTER = {after}


def kill_mean(ctx):
    \"\"\"A1's weights. Armed (the file holds the driver's process group), the one extractor, on its first batch
    after AFTER concepts are marked pooled, disarms and SIGKILLs the driver's group and then itself.\"\"\"
    armed = HOOK / "armed"
    if armed.exists():
        done = [p for p in POOLED.glob("*.json") if not p.name.endswith({sidecar!r})]
        if len(done) == AFTER:
            group = int(armed.read_text())
            (HOOK / "killed").write_text(" ".join(sorted(p.name for p in done)))
            armed.unlink()
            os.killpg(group, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    return np.ones(ctx.attention_mask.shape)


register_strategy(StrategySpec(id="X8_kill_mean", code="X8", family="other", kind="weights",
                               weights_fn=kill_mean, description="A1_mean that can kill the run at a known point."))
"""


def pooled_manifests(store_dir: Path) -> list[str]:
    """Concepts marked pooled: their manifests, written under the concept key after every layer shard."""
    return sorted(p.name for p in (store_dir / "pooled").glob("*.json") if not p.name.endswith(SIDECAR_SUFFIX))


def test_killed_driver_resumes_without_recomputing(tiny_llama_dir, cache, tmp_path):
    """One extractor pools the concepts in order; a strategy plugin kills the driver's whole process group and
    its own worker on the first batch after exactly AFTER concepts are marked pooled. The rerun skips exactly
    those AFTER concepts and pools exactly the rest."""
    after = 2
    store_dir, hook = tmp_path / "store", tmp_path / "hook"
    hook.mkdir()
    plugin = tmp_path / "kill_strategy.py"
    plugin.write_text(KILL_PLUGIN.format(hook=str(hook), pooled=str(store_dir / "pooled"), after=after,
                                         sidecar=SIDECAR_SUFFIX))
    main = "from poolbench.cli.app import main; main()"
    # The first run arms the plugin itself, before anything runs: the file holds its own process group.
    arm = f"import os, pathlib; pathlib.Path({str(hook / 'armed')!r}).write_text(str(os.getpgid(0))); "
    args = ["run", "--model", str(tiny_llama_dir),
            "--corpus-size", "tiny", "--concepts", ",".join(MANY), "--strategies", "A1_mean,X8_kill_mean",
            "--strategy-module", str(plugin), "--num-workers", "1",
            "--store", str(store_dir), "--n-bootstrap", "100", "--no-reliability", "--no-steering",
            "--torch-threads", "1", "--out", str(tmp_path / "out")]
    env = {**os.environ, "POOLBENCH_CACHE": str(cache)}
    driver = subprocess.Popen([sys.executable, "-c", arm + main, *args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = driver.communicate(timeout=600)
    assert driver.returncode == -signal.SIGKILL, stderr[-2000:]
    killed_after = (hook / "killed").read_text().split()
    assert len(killed_after) == after and pooled_manifests(store_dir) == killed_after
    assert not (tmp_path / "out" / "results.json").exists()

    rerun = subprocess.run([sys.executable, "-c", main, *args], env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    computed = json.loads((tmp_path / "out" / "results.json").read_text())["computed"]
    assert computed["pooled_skipped"] == after
    assert computed["pooled"] == len(MANY) - after
    assert len(pooled_manifests(store_dir)) == len(MANY)


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
