"""cluster-up refuses a taken port in one line and starts nothing; a failed step rolls back what it started."""

from __future__ import annotations

import socket

import pytest
from s3_server import free_port

from poolbench.cluster.launcher import ClusterError, cluster_down, cluster_up
from poolbench.errors import PoolBenchError


def test_a_taken_port_is_named_and_nothing_starts(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ClusterError, match=f"^port {port} is already in use \\(Ray head\\)"):
            cluster_up(ray_port=port, state=tmp_path / "state", store="")
    assert not (tmp_path / "state").exists()


def test_a_failing_step_stops_what_was_started(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    state = tmp_path / "state"
    s3_port = free_port()
    # The S3 server starts, then the bucket name is refused: the server must be stopped again.
    with pytest.raises(ClusterError, match=r"cannot create bucket 'pb' on http://127\.0\.0\.1:"):
        cluster_up(ray_port=free_port(), serve_port=free_port(), s3_port=s3_port, store="s3://pb/x", state=state)
    assert not list(state.glob("*.pid")) and not (state / "cluster.json").exists()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", s3_port))  # the port is free again: the server is gone
    assert cluster_down(state) == []


def test_a_run_folder_without_scorers_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text('{"config": {}, "cells": []}')
    with pytest.raises(PoolBenchError, match=r"results\.json: the run recorded no scorers"):
        cluster_up(ray_port=free_port(), serve_port=free_port(), state=tmp_path / "state", store="",
                   run=tmp_path / "run")
    assert not (tmp_path / "state").exists()
