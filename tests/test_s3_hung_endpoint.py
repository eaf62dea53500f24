"""An S3 endpoint that accepts connections and never answers fails in one line within a bounded number of tries."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from poolbench.errors import StoreError
from poolbench.store.s3 import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_RETRIES,
    S3Store,
    worst_case_s,
)
from poolbench.store.url import open_store


class HungServer:
    """A loopback socket that accepts every connection, counts it, and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer()
    yield server
    server.close()


def test_a_hung_endpoint_fails_in_one_line_after_the_configured_attempts(hung: HungServer):
    with pytest.raises(StoreError) as caught:
        S3Store("bucket", "p", hung.url, access_key="a", secret_key="b", read_timeout_s=0.3, retries=2)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (f"S3 endpoint {hung.url} timed out while checking the bucket after 3 attempts "
                       "(timeouts: connect 2 s, read 0.3 s; is the server running?)")
    assert len(hung.accepted) == 3  # one try and two retries, no more


def test_the_default_bound_is_under_30_seconds():
    assert (DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, DEFAULT_RETRIES) == (2.0, 7.0, 2)
    assert worst_case_s(2.0, 7.0, 2) == pytest.approx(3 * 9.0 + 0.2)  # urllib3 sleeps 0, then 0.2 s
    assert worst_case_s(DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, DEFAULT_RETRIES) <= 30


def test_the_environment_sets_timeouts_and_retries(hung: HungServer, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POOLBENCH_S3_ENDPOINT", hung.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    monkeypatch.setenv("POOLBENCH_S3_READ_TIMEOUT", "0.2")
    monkeypatch.setenv("POOLBENCH_S3_RETRIES", "1")
    with pytest.raises(StoreError, match=r"after 2 attempts \(timeouts: connect 2 s, read 0.2 s"):
        open_store("s3://bucket/prefix")
    assert len(hung.accepted) == 2
    monkeypatch.setenv("POOLBENCH_S3_RETRIES", "many")
    with pytest.raises(StoreError, match="POOLBENCH_S3_RETRIES='many' is not a number"):
        open_store("s3://bucket/prefix")


def test_the_driver_says_so_in_one_line(hung: HungServer):
    import os
    import subprocess
    import sys

    env = {**os.environ, "POOLBENCH_S3_ENDPOINT": hung.url, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b",
           "POOLBENCH_S3_READ_TIMEOUT": "0.3"}
    result = subprocess.run([sys.executable, "-c", "from poolbench.cli.app import main; main()", "store", "verify",
                             "--store", "s3://bucket/p"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"error: S3 endpoint {hung.url} timed out while checking the bucket after "
                                          "3 attempts (timeouts: connect 2 s, read 0.3 s; is the server running?)"]
