"""GET /leaderboard over real HTTP (uvicorn on a free loopback port): a cross-model run's table, a single run's
leaderboard, 404 without a run, and a start that fails in one line on a folder that is no finished run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from s3_server import free_port
from test_cross_model_report import cross_run

from poolbench.errors import PoolBenchError
from poolbench.http.app import build_api
from poolbench.http.leaderboard_route import leaderboard_of_run, run_serving
from poolbench.http.settings import ServiceSettings


@contextmanager
def serving(settings: ServiceSettings) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_api(settings), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_leaderboard_serves_the_cross_model_table_and_a_single_run(tmp_path: Path) -> None:
    run = cross_run(tmp_path / "run")
    table = json.loads((run / "results.json").read_text())["cross_model"]
    with serving(ServiceSettings(models=(), **leaderboard_of_run(run))) as base:
        answer = httpx.get(f"{base}/leaderboard", timeout=10)
        assert answer.status_code == 200
        assert answer.json()["kind"] == "cross_model" and answer.json()["cross_model"] == table
        assert answer.json()["cross_model"]["agreement"]["kendall_w"] == pytest.approx(1.0)
    single = json.loads((run / "small" / "leaderboard.json").read_text())
    with serving(ServiceSettings(models=(), **leaderboard_of_run(run / "small"))) as base:
        assert httpx.get(f"{base}/leaderboard", timeout=10).json() == single
    with serving(ServiceSettings(models=())) as base:
        missing = httpx.get(f"{base}/leaderboard", timeout=10)
        assert missing.status_code == 404 and "--run" in missing.json()["detail"]
    with pytest.raises(PoolBenchError, match="is not a finished run folder"):
        leaderboard_of_run(tmp_path / "nowhere")


def test_run_serving_gives_a_cross_model_run_its_table_and_a_single_run_its_scorers_too(tmp_path: Path) -> None:
    run = cross_run(tmp_path / "run")
    assert set(run_serving(run)) == {"leaderboard"}
    with pytest.raises(PoolBenchError, match="the run recorded no scorers"):  # a model folder of a --no-steering run
        run_serving(run / "small")
