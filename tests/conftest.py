"""Shared pytest fixtures. Store fixtures: ``moto_s3`` (one real S3 server per session) and
``artifact_store`` (each store test runs once on LocalStore and once on S3Store)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from poolbench.s3_store import S3Store
from poolbench.store import ArtifactStore, LocalStore
from s3_server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    """A moto S3 server in a child process for the whole session, terminated at the end."""
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def s3_store_on(server: MotoServer, prefix: str = "artifacts") -> S3Store:
    """An S3Store on a fresh bucket of ``server``, so tests never see each other's objects."""
    bucket = server.make_bucket(f"poolbench-test-{next(_bucket_ids)}")
    return S3Store(
        bucket, prefix, server.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION
    )


@pytest.fixture(params=["local", "s3"])
def artifact_store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """The same store contract, once per backend."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store_on(request.getfixturevalue("moto_s3"))
