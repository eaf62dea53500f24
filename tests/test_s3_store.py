"""S3Store against a real S3 server process: configuration, fail-fast errors, outage and recovery."""

from __future__ import annotations

import inspect
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import urllib3
from bad_http_server import bad_http_server
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer, free_port, s3_store_on
from waiting import wait_until

from poolbench.errors import StoreError
from poolbench.store.s3 import S3Store
from poolbench.store.url import open_store

# How many times S3Store tries one request by default: the first try and its retries (counted, never timed).
TRIES = 1 + inspect.signature(S3Store).parameters["retries"].default


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection urllib3 opens from now on, as (host, port)."""
    attempts: list[tuple[str, int]] = []
    real = urllib3.connection.HTTPConnection._new_conn

    def counted(self):
        attempts.append((self.host, self.port))
        return real(self)

    monkeypatch.setattr(urllib3.connection.HTTPConnection, "_new_conn", counted)
    return attempts


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, moto_s3: MotoServer) -> MotoServer:
    monkeypatch.setenv("POOLBENCH_S3_ENDPOINT", moto_s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_REGION", raising=False)
    return moto_s3


def test_open_store_s3_from_env(s3_env: MotoServer) -> None:
    s3_env.make_bucket("pb-open")
    store = open_store("s3://pb-open/runs/a/")
    assert isinstance(store, S3Store)
    assert store.describe() == f"s3://pb-open/runs/a/ @ {s3_env.endpoint}"
    store.put_json("d1/x", {"v": 1})
    names = [o.object_name for o in s3_env.client().list_objects("pb-open", recursive=True)]
    assert names == ["runs/a/d1/x.json"]
    stat = s3_env.client().stat_object("pb-open", "runs/a/d1/x.json")
    assert stat.content_type == "application/json"


@pytest.mark.parametrize("var", ["POOLBENCH_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_open_store_names_missing_env(s3_env: MotoServer, monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.delenv(var)
    with pytest.raises(StoreError, match=rf"^{var} is not set"):
        open_store("s3://pb-open/x")


def test_refused_endpoint_fails_fast_in_one_line(monkeypatch: pytest.MonkeyPatch, connects) -> None:
    """Fast means a bounded number of tries: the first and the configured retries, then one line."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("POOLBENCH_S3_ENDPOINT", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    with pytest.raises(StoreError) as info:
        open_store("s3://anything/p")
    assert connects == [("127.0.0.1", port)] * TRIES
    message = str(info.value)
    assert message.startswith(f"S3 endpoint {endpoint} refused the connection")
    assert "\n" not in message


def test_missing_bucket_is_named(moto_s3: MotoServer) -> None:
    with pytest.raises(StoreError, match=r"^S3 bucket 'no-such-bucket' does not exist at http://127\.0\.0\.1:"):
        S3Store("no-such-bucket", "", moto_s3.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)


def test_non_s3_server_is_not_mistaken_for_a_missing_bucket(tmp_path: Path) -> None:
    """A plain web server answers 404 to everything; that must not read as 'bucket does not exist'."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        def listening() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, f"http.server on port {port}")
        with pytest.raises(StoreError, match=r"does not answer like an S3 server .*HTTP 404"):
            S3Store("bucket", "", f"http://127.0.0.1:{port}", access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_a_hanging_endpoint_times_out_in_one_line_after_bounded_tries() -> None:
    """A server that accepts and never answers: each try ends at the read timeout, TRIES of them, then one line.
    Depends on S3Store's `read_timeout_s` / `retries` keywords (shared/store/s3.py)."""
    with bad_http_server("stall") as server:
        with pytest.raises(StoreError) as info:
            S3Store("bucket", "", server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                    read_timeout_s=0.5, retries=2)
        assert server.requests == [b"HEAD /bucket HTTP/1.1"] * 3
    message = str(info.value)
    assert message.startswith(f"S3 endpoint {server.endpoint} timed out while checking the bucket")
    assert "\n" not in message


def test_5xx_answers_are_retried_a_bounded_number_of_times_then_one_line() -> None:
    """A server that answers 500 to everything: the same request TRIES times, then one line naming endpoint and
    status (never 'bucket does not exist', never a traceback)."""
    with bad_http_server("500") as server:
        with pytest.raises(StoreError) as info:
            S3Store("bucket", "", server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        assert server.requests == [b"HEAD /bucket HTTP/1.1"] * TRIES
    message = str(info.value)
    assert message.startswith(f"S3 endpoint {server.endpoint} ") and "500" in message
    assert "does not exist" not in message and "\n" not in message


def test_bad_endpoint_and_bucket_name() -> None:
    with pytest.raises(StoreError, match="invalid S3 endpoint 'ftp://h:1'"):
        S3Store("b", "", "ftp://h:1")
    with pytest.raises(StoreError, match="invalid S3 endpoint"):
        S3Store("b", "", "http://h:1/some/path")


def test_prefixes_isolate_stores(moto_s3: MotoServer) -> None:
    first = s3_store_on(moto_s3, prefix="one")
    second = S3Store(first.bucket, "two", moto_s3.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    first.put_bytes("k/a", b"1")
    second.put_bytes("k/b", b"2")
    assert first.list() == ["k/a"]
    assert second.list() == ["k/b"]
    assert not second.exists("k/a")


def test_object_metadata_carries_checksum(moto_s3: MotoServer) -> None:
    store = s3_store_on(moto_s3)
    store.put_bytes("raw/x", b"abc", metadata={"model": "gpt2"})
    stat = moto_s3.client().stat_object(store.bucket, "artifacts/raw/x.bin")
    sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert stat.metadata["x-amz-meta-poolbench-sha256"] == sha
    assert stat.metadata["x-amz-meta-poolbench-metadata"] == '{"model": "gpt2"}'


def test_outage_then_recovery(tmp_path: Path, connects) -> None:
    """Stopping the server makes the next put fail in one line; once it is back, a retry succeeds."""
    server = MotoServer()
    server.start()
    try:
        bucket = server.make_bucket("pb-outage")
        store = S3Store(
            bucket, "p", server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION
        )
        store.put_bytes("k/one", b"1")
        server.stop()
        connects.clear()
        with pytest.raises(StoreError) as info:
            store.put_bytes("k/two", b"2")
        assert connects == [("127.0.0.1", server.port)] * TRIES  # bounded retries, then one line
        refused = f"S3 endpoint {server.endpoint} refused the connection while writing k/two.bin"
        assert str(info.value).startswith(refused)
        server.start()
        server.make_bucket(bucket)  # moto keeps state in memory: the restarted server is empty
        store.put_bytes("k/two", b"2")
        assert store.get_bytes("k/two") == b"2"
    finally:
        server.stop()
