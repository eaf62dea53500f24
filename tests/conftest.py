"""Shared pytest fixtures. Store fixtures: ``moto_s3`` (one real S3 server per session) and
``artifact_store`` (each store test runs once on LocalStore and once on S3Store)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_server import MotoServer, s3_store_on

from poolbench.store import ArtifactStore, LocalStore


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoServer]:
    """A moto S3 server in a child process for the whole session, terminated at the end."""
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["local", "s3"])
def artifact_store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """The same store contract, once per backend."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return s3_store_on(request.getfixturevalue("moto_s3"))
