"""The HTTP app's bearer token: required on every path but /healthz once set, and required beyond loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from poolbench.http.access import check_exposure, is_loopback_host, with_token
from poolbench.http.app import build_api, start_serve
from poolbench.http.service_errors import ServiceConfigError
from poolbench.http.settings import ServiceSettings

TOKEN = "0123456789abcdef0123"


@pytest.fixture
def client() -> TestClient:
    return TestClient(build_api(ServiceSettings(models=(), token=TOKEN)))


def test_requests_without_the_token_get_401(client: TestClient):
    body = {"concept": "hedging", "texts": ["x"]}
    assert client.get("/healthz").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": f"Basic {TOKEN}"}):
        reply = client.post("/score", json=body, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert reply.json() == {"detail": "missing or wrong bearer token"}
    assert client.get("/openapi.json").status_code == 401
    # with it, the request reaches the handler: no scorer for the concept here is a 404, not a 401
    reply = client.post("/score", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 404 and "no scorer for concept 'hedging'" in reply.json()["detail"]


def test_no_token_means_no_auth():
    reply = TestClient(build_api(ServiceSettings(models=()))).post("/score", json={"concept": "x", "texts": ["y"]})
    assert reply.status_code == 404


def test_the_token_is_never_shown():
    settings = ServiceSettings(models=(), token=TOKEN)
    assert TOKEN not in repr(settings) and "token" not in settings.model_dump(mode="json")


def test_beyond_loopback_needs_a_token(monkeypatch: pytest.MonkeyPatch):
    assert [is_loopback_host(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback_host(h) for h in ("0.0.0.0", "::", "192.0.2.2", "example.org")] == [False] * 4
    check_exposure("127.0.0.1", None)
    check_exposure("0.0.0.0", TOKEN)
    with pytest.raises(ServiceConfigError, match=r"refusing to serve on 0\.0\.0\.0 without a bearer token"):
        check_exposure("0.0.0.0", None)
    monkeypatch.delenv("POOLBENCH_TOKEN", raising=False)
    with pytest.raises(ServiceConfigError, match=r"refusing to serve on 0\.0\.0\.0"):
        start_serve(ServiceSettings(models=()), host="0.0.0.0", port=1)  # refused before Serve starts
    with pytest.raises(ServiceConfigError, match="the bearer token has 5 characters; use at least 16"):
        with_token(ServiceSettings(models=()), "short")


def test_the_driver_refuses_to_serve_beyond_loopback_without_a_token():
    env = {k: v for k, v in os.environ.items() if k != "POOLBENCH_TOKEN"}
    for command in (["serve-scorers", "--host", "0.0.0.0"], ["cluster", "up", "--host", "0.0.0.0"]):
        result = subprocess.run([sys.executable, "-c", "from poolbench.cli.app import main; main()", *command],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 1
        assert result.stderr.splitlines() == ["error: refusing to serve on 0.0.0.0 without a bearer token: pass "
                                              "--token or set POOLBENCH_TOKEN (or listen on 127.0.0.1)"]
