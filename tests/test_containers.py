"""The image and the compose stack, for real (`make test-containers`, marked `containers`, outside `make test`):
the image `make image` built runs offline as a non-root user with its models inside; the operator's compose file,
the local override and this test's own layer run S3, a Ray head, two Ray worker containers, the HTTP service and the
driver on one bridge network under podman; a worker container killed while it holds a pooling job costs time, never
cells (equal to a single-process run of the same settings in the same image); `down` leaves nothing behind."""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from container_stack import IMAGE, PINNED_THREADS, ComposeStack, compose_layer, networks, podman, volumes, wait_until
from tiny_models import save_tiny_llama

pytestmark = pytest.mark.containers

CONCEPTS = "hedging,toxicity,contrast,causation"
# The same settings for the single-process run and the cluster run: one torch thread, one concept per job, one
# batch budget; only --address, --store and --out differ.
RUN_ARGS = ("--model", "/assets/tiny-llama", "--corpus-size", "tiny", "--concepts", CONCEPTS,
            "--strategies", "A1_mean,X8_slow_mean", "--strategy-module", "/assets/slow_strategies.py",
            "--layers", "1", "--n-bootstrap", "100", "--torch-threads", "1", "--batch-size", "32",
            "--max-batch-tokens", "8192", "--concept-group-tokens", "0", "--no-reliability", "--no-steering")

# A1_mean that takes 3 s a batch and, in a worker container (/signals mounted), first says which node holds it:
# the test kills that container inside the 3 s, while the job is held (no race with a fast tiny run).
SLOW_MEAN = """
import time
from pathlib import Path

import numpy as np
import ray

from poolbench.pooler.registry import register_strategy
from poolbench.pooler.spec import StrategySpec


def slow_mean(ctx):
    signals = Path("/signals")
    if signals.is_dir():
        (signals / ray.util.get_node_ip_address()).touch()
    time.sleep(3.0)
    return np.ones(ctx.attention_mask.shape)


register_strategy(StrategySpec(id="X8_slow_mean", code="X8", family="other", kind="weights", weights_fn=slow_mean,
                               description="A1_mean that takes three seconds a batch."))
"""


@pytest.fixture(scope="module")
def assets() -> Iterator[Path]:
    """Host folders the containers' user (uid 1000) can read (model, plugin) and write (signals, run folders)."""
    root = Path(tempfile.mkdtemp(prefix="poolbench-containers-"))
    try:
        (root / "shared").mkdir()
        save_tiny_llama(root / "shared" / "tiny-llama")
        (root / "shared" / "slow_strategies.py").write_text(SLOW_MEAN)
        for writable in ("signals", "runs"):
            (root / writable).mkdir()
            (root / writable).chmod(0o777)
        for path in (root, *root.rglob("*")):
            path.chmod(path.stat().st_mode | 0o755 if path.is_dir() else path.stat().st_mode | 0o644)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(assets: Path) -> Iterator[ComposeStack]:
    """The whole stack up, both workers joined; down (volumes included) at the end whatever happened."""
    assert podman("image", "exists", IMAGE, check=False).returncode == 0, f"{IMAGE} is not built: run `make image`"
    layer = assets / "compose.test.yml"
    layer.write_text(yaml.safe_dump(compose_layer(assets)))
    project = f"pbtest{uuid.uuid4().hex[:8]}"
    stack = ComposeStack(project, layer, token=secrets.token_hex(16))
    try:
        # In order, each once the one before answers: podman before 4.6 cannot wait for a health check or a job
        # that completed (compose's depends_on conditions), and a Ray worker needs its head.
        stack.compose("up", "-d", "--no-build", "--no-deps", "minio", "minio-bucket", "ray-head", "http", timeout=600)
        [head] = stack.container_of("ray-head")
        wait_until("the Ray head", lambda: stack.alive_ray_nodes(head) == 1, 300, 3)
        stack.compose("up", "-d", "--no-build", "--no-deps", "ray-worker", timeout=600)
        wait_until("the Ray head and two worker containers", lambda: stack.alive_ray_nodes(head) == 3, 300, 3)
        [bucket] = stack.container_of("minio-bucket")
        wait_until("the bucket", lambda: podman("inspect", bucket, "--format", "{{.State.Status}} {{.State.ExitCode}}")
                   .stdout.split() == ["exited", "0"], 150, 2)
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.down()


def test_the_image_runs_offline_as_a_non_root_user_with_its_models_inside():
    """No network at all: the embedded SmolLM2 is already converted in /cache, spaCy's model and MiniLM load."""
    probe = ("import json, os; from poolbench.extractor.loading import local_model_dir; "
             "from poolbench.pooler.parses import load_nlp; "
             "from poolbench.scorer.encoder import bundled_minilm_path; "
             "print(json.dumps([os.getuid(), str(local_model_dir('embedded')), load_nlp().lang, "
             "(bundled_minilm_path() / 'config.json').is_file()]))")
    started = time.monotonic()
    done = podman("run", "--rm", "--network", "none", IMAGE, "python", "-c", probe, timeout=180)
    uid, model_dir, spacy_lang, minilm = json.loads(done.stdout.strip().splitlines()[-1])
    assert (uid, spacy_lang, minilm) == (1000, "en", True)
    assert model_dir.startswith("/cache/")
    assert time.monotonic() - started < 120  # nothing converted or downloaded on the way


def python_in_driver(stack: ComposeStack, script: str, timeout: float = 900) -> str:
    """A Python script in a container of the driver's service (on the stack's network; not joining Ray)."""
    done = stack.compose("run", "--rm", "--no-deps", "-T", "--entrypoint", "python", "driver", "-c", script,
                         timeout=timeout)
    return done.stdout


def test_the_http_service_answers_healthz_and_pool_from_its_container(stack):
    """From the driver's container, over the stack's network, by service name: /healthz open, /pool with the token."""
    token = stack.env["POOLBENCH_TOKEN"]
    client = f"""
import json, time, urllib.request
deadline = time.monotonic() + 420
while True:
    try:
        health = json.load(urllib.request.urlopen("http://http:8000/healthz", timeout=10))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(3)
body = json.dumps({{"model": "embedded", "layer": 6, "strategy": "A1_mean", "texts": ["a pooled sentence", "two"]}})
request = urllib.request.Request("http://http:8000/pool", data=body.encode(), method="POST",
    headers={{"Content-Type": "application/json", "Authorization": "Bearer {token}"}})
pooled = json.load(urllib.request.urlopen(request, timeout=300))
print(json.dumps({{"health": health, "dim": pooled["dim"], "n": len(pooled["vectors"]),
                   "width": len(pooled["vectors"][0]), "strategy": pooled["strategy"]}}))
"""
    answer = json.loads(python_in_driver(stack, client, timeout=600).strip().splitlines()[-1])
    assert answer["n"] == 2 and answer["width"] == answer["dim"] == 576  # SmolLM2-135M's hidden size
    assert answer["strategy"] == "A1_mean"
    assert "embedded" in json.dumps(answer["health"])


def cells(results: dict) -> list[dict]:
    return sorted(results["cells"], key=lambda c: (c["concept"], c["strategy"], json.dumps(c, sort_keys=True)))


def test_a_killed_worker_container_costs_time_never_cells(stack, assets):
    """The single-process run (no network, a local store) and the cluster run (S3, two worker containers, one
    killed with `podman kill` while its slow job is held) give equal cells; results.json names the lost node."""
    pins = [w for k, v in PINNED_THREADS.items() for w in ("-e", f"{k}={v}")]
    single = podman("run", "--rm", "--network", "none", *pins,
                    "-v", f"{assets / 'shared'}:/assets:ro", "-v", f"{assets / 'runs'}:/runs", IMAGE,
                    "poolbench-driver", "run", *RUN_ARGS, "--store", "/home/poolbench/store", "--out", "/runs/single",
                    timeout=900)
    assert (assets / "runs" / "single" / "results.json").is_file(), single.stdout[-2000:]

    workers = stack.container_of("ray-worker")
    assert len(workers) == 2
    ip_to_container = {stack.ip_of(w): w for w in workers}
    log = assets / "cluster-run.log"
    # the driver service's entrypoint joins the cluster as a node without CPUs, then runs this
    driver = stack.popen("run", "--rm", "--no-deps", "-T", "driver", "poolbench-driver", "run", "--address", "auto",
                         *RUN_ARGS, "--store", "s3://poolbench/artifacts", "--out", "/runs/cluster", log=log)
    killed: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while not killed and driver.poll() is None and time.monotonic() < deadline:
            holding = [p.name for p in (assets / "signals").iterdir() if p.name in ip_to_container]
            if holding:
                killed.append(holding[0])
                podman("kill", ip_to_container[holding[0]])
            time.sleep(0.2)
        assert killed, f"no worker container took a slow job: {log.read_text()[-3000:]}"
        assert driver.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    results = json.loads((assets / "runs" / "cluster" / "results.json").read_text())
    single_results = json.loads((assets / "runs" / "single" / "results.json").read_text())
    assert cells(results) == cells(single_results)
    assert {c["concept"] for c in results["cells"]} == set(CONCEPTS.split(","))
    [lost] = results["cluster"]["lost_nodes"]
    assert lost.split(":")[0] == killed[0]
    pool_retries = [r for r in results["cluster"]["retried"] if r["job"].startswith("pool ")]
    assert pool_retries and all(r["node"] == lost for r in pool_retries)  # the job it held ran again elsewhere


def test_compose_down_leaves_no_container_network_or_volume(stack):
    stack.down()
    assert stack.containers() == {}
    assert networks() - stack.networks_before == set()
    assert volumes() - stack.volumes_before == set()
