"""Shared pytest fixtures. Store fixtures: ``moto_s3`` (one real S3 server per session) and
``artifact_store`` (each store test runs once on LocalStore and once on S3Store). The whole session, its Ray
workers and its subprocesses use a temporary POOLBENCH_CACHE: no test reads or writes the user's ~/.cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpu_kernels import PROFILE_ENV, REBLOCKED, profile_mismatches
from s3_server import MotoServer, s3_store_on

from poolbench.store.artifact_store import ArtifactStore
from poolbench.store.local import LocalStore

pytest_plugins = ["skip_policy"]

_SESSION_CACHE_ENV = "_POOLBENCH_TEST_SESSION_CACHE"
TRAINED_TINY = "trained_tiny"
_TINY_BUILD = ("import os; os.nice(10)\n"
               "from poolbench.extractor.tiny_model import ensure_tiny_model; ensure_tiny_model()")
_background: list[subprocess.Popen] = []


def pytest_configure(config: pytest.Config) -> None:
    """Before collection: in a run under another CPU's kernels (tests/cpu_kernels.py) stop unless torch and numpy
    did switch; point POOLBENCH_CACHE at a fresh temp dir for the session (removed at its end)."""
    profile = os.environ.get(PROFILE_ENV)
    if profile in REBLOCKED:
        from reblocked import install_reblocking

        install_reblocking()
    if profile:
        wrong = profile_mismatches(profile)
        if wrong:
            raise pytest.UsageError(f"CPU profile {profile!r} did not take: {'; '.join(wrong)} (a CPU without "
                                    f"these instructions: set CPU_PROFILES to the ones it has)")
    root = tempfile.mkdtemp(prefix="poolbench-test-cache-")
    os.environ[_SESSION_CACHE_ENV] = root
    os.environ["POOLBENCH_CACHE"] = root
    # D2's fluency guard reads the steered (test) model itself unless a test names a reference: no second model
    os.environ.setdefault("POOLBENCH_FLUENCY_REFERENCE", "self")
    config.addinivalue_line("markers", f"{TRAINED_TINY}: loads the trained `tiny` model (3 min of one core to "
                            "build into a fresh cache): a session that selects one builds it in the background")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The trained tiny model is built into the session's fresh cache by a low-priority child as soon as the tests
    are known, on whatever the earlier tests leave of the cores, instead of inside the first test that loads it
    (its setup took 213 of 218 s). That test then waits on ensure_tiny_model's lock, or finds the model built; a
    failed background build leaves the test to build it and fail as it would have."""
    if not any(item.get_closest_marker(TRAINED_TINY) for item in session.items):
        return
    log = Path(os.environ[_SESSION_CACHE_ENV]) / "tiny-build.log"
    with open(log, "w") as out:
        _background.append(subprocess.Popen([sys.executable, "-c", _TINY_BUILD], stdout=out, stderr=out,
                                            stdin=subprocess.DEVNULL))


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say which kernels this run holds torch and numpy to, so a log shows the profile really ran."""
    profile = os.environ.get(PROFILE_ENV)
    if not profile:
        return None
    import torch
    from cpu_kernels import numpy_dispatch

    return (f"CPU profile {profile}: torch {torch.backends.cpu.get_cpu_capability()} kernels on "
            f"{torch.get_num_threads()} threads, numpy SIMD beyond baseline: {numpy_dispatch() or 'none'}"
            + (" ; GEMMs blocked by row count, small default forwards (tests/reblocked.py)" if profile in REBLOCKED
               else ""))


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in _background:  # a session that ended before its build did (a failure, -x, a selection)
        proc.terminate()
        proc.wait(timeout=30)
    root = os.environ.pop(_SESSION_CACHE_ENV, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's temp cache (built models and corpora are shared by the tests that use it), set for the test
    even if an earlier one changed POOLBENCH_CACHE."""
    root = Path(os.environ[_SESSION_CACHE_ENV])
    monkeypatch.setenv("POOLBENCH_CACHE", str(root))
    return root


@pytest.fixture
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch at two threads for the test (CI's cores; another count by indirect parametrisation), then as before: a
    bit-equality that rests on how a CPU kernel splits its elements among threads (logsumexp_rows) is checked at a
    thread count it holds for, on any machine."""
    import torch

    threads = int(getattr(request, "param", 2))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(saved)


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, d=32 Llama saved in HF format, shared by the tests that need a whole model."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def layered_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with weights at std 0.2, so each block moves the residual stream: a delta added after layer 0
    and the same delta after layer 1 give different text (at the default init they give the same)."""
    from tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("models") / "layered-llama", weight_std=0.2)


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 32-wide BERT with MiniLM's tokenizer: a classifier B that fine-tunes in a second on CPU."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from poolbench.scorer.encoder import bundled_minilm_path

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(bundled_minilm_path())
    model = BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=64))
    out = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def local_ray() -> None:
    """One local Ray shared by the tests that ask for it (starting Ray costs seconds), started again for a module
    when an earlier one left none (the loopback-cluster tests connect the driver to a cluster of their own and shut
    it down; no module mixes both); module-scoped so a module's Serve app or engine fixture can hold it. Ray stops
    at exit. It is the driver's private Ray (poolbench.driver.local_ray): on 127.0.0.1, Serve's listener too, so no
    test's traffic leaves loopback."""
    import ray

    from poolbench.driver.local_ray import LOOPBACK_RUNTIME_ENV, init_local_ray

    if not ray.is_initialized():
        init_local_ray(num_cpus=2, runtime_env=LOOPBACK_RUNTIME_ENV)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA: skipped, with the reason, on machines without it."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
