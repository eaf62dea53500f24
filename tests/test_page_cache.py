"""Reading a model's weights ahead: the files end up in the page cache (the kernel's own mincore says so), nothing
is read when they would not fit, a vanished file is no error, and the driver reads the folder its workers load."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from poolbench.config import RunConfig
from poolbench.extractor import page_cache
from poolbench.extractor.loading import weight_files
from poolbench.extractor.page_cache import read_ahead

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache: mincore(2) over a shared read-only mapping, which maps the
    cache's own pages and reads none in."""
    size = path.stat().st_size
    pages = (size + PAGE - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def weights(tmp_path) -> list[Path]:
    paths = []
    for i, size in enumerate((3 * 2**20 + 17, 5 * 2**20)):
        path = tmp_path / f"model-{i}.safetensors"
        path.write_bytes(os.urandom(size))
        os.sync()  # clean pages, so the kernel may drop them
        _evict(path)
        paths.append(path)
    return paths


def test_the_files_are_in_the_page_cache_after_the_read(weights):
    if max(resident_share(p) for p in weights) > 0.2:
        pytest.skip("this kernel kept the pages after POSIX_FADV_DONTNEED; residency cannot be shown here")
    thread = read_ahead(weights)
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert [resident_share(p) for p in weights] == [1.0, 1.0]


def test_nothing_is_read_when_the_files_would_not_fit(weights, monkeypatch):
    total = sum(p.stat().st_size for p in weights)
    monkeypatch.setattr(page_cache, "free_memory_bytes", lambda device: int(total / page_cache.MEMORY_SHARE) - 1)
    assert read_ahead(weights) is None
    monkeypatch.setattr(page_cache, "free_memory_bytes", lambda device: int(total / page_cache.MEMORY_SHARE))
    thread = read_ahead(weights)
    assert thread is not None
    thread.join(timeout=60)


def test_a_vanished_file_is_skipped_without_an_error(weights, tmp_path):
    assert read_ahead([tmp_path / "gone.safetensors"]) is None
    thread = read_ahead([weights[0], weights[1]])
    weights[0].unlink()
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_the_driver_reads_ahead_the_folder_its_workers_load(tiny_llama_dir, monkeypatch):
    from poolbench.driver import pipeline

    seen: list[list[Path]] = []
    monkeypatch.setattr(pipeline, "read_ahead", lambda paths: seen.append(list(paths)))
    pipeline.prepare_model(RunConfig(model=str(tiny_llama_dir), steering=False), lambda event: None)
    assert seen == [weight_files(tiny_llama_dir)] and seen[0]
