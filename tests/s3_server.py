"""A real S3 server (moto) in a child process: S3Store is tested over HTTP, never via an in-process mock."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from minio import Minio

from poolbench.store.s3 import S3Store

ACCESS_KEY = "poolbench-test"
SECRET_KEY = "poolbench-test-secret"
REGION = "us-east-1"


def free_port() -> int:
    """A TCP port nothing listens on right now (bound once, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    """``moto_server`` on 127.0.0.1:<port>; stop() and start() again keep the port (state is in memory)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1])

    def start(self, timeout_s: float = 30.0) -> None:
        script = Path(sys.executable).with_name("moto_server")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                [*cmd, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited early: {self._log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # any HTTP answer means it is serving
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout_s}s")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None

    def client(self) -> Minio:
        host = f"127.0.0.1:{self.port}"
        return Minio(host, access_key=ACCESS_KEY, secret_key=SECRET_KEY, secure=False, region=REGION)

    def make_bucket(self, name: str) -> str:
        client = self.client()
        if not client.bucket_exists(name):
            client.make_bucket(name)
        return name


def s3_store_on(server: MotoServer, prefix: str = "artifacts") -> S3Store:
    """An S3Store on a fresh bucket of ``server``, so tests never see each other's objects."""
    bucket = server.make_bucket(f"poolbench-test-{uuid.uuid4().hex[:12]}")
    return S3Store(
        bucket, prefix, server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION
    )
