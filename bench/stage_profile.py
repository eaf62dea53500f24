"""One more repeat of a pooling stage under torch.profiler: where its device and host time go, by phase of the
capture and by op, with the kernels it launched and the waits on the device, so one GPU call says what a stage's
time over the raw forward is made of (the timed repeats run without it).

Phases are the capture's own functions, wrapped in `record_function` for the profiled repeat only (the code under
measurement carries no annotations): each phase's host time includes what it calls, its device time the kernels
launched inside it. On a CPU, device times are 0 and the host times are the work itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import wraps
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

# phase -> (module, attribute path): the function the capture calls for that part of a chunk's work
PHASES: dict[str, tuple[str, str]] = {
    "attention_inflow": ("poolbench.extractor.attention_capture", "_record"),
    "pool_layer": ("poolbench.pooler.device_pool", "DevicePooler.__call__"),
    "pool_finish": ("poolbench.pooler.device_pool", "DevicePooler.finish"),
    "s2_head": ("poolbench.extractor.lm_head_likelihood", "log_likelihood_and_gradient"),
    "s2_backward": ("poolbench.extractor.lm_head_likelihood", "layer_gradients"),  # with S2 layers pooled in it
    "s2_sums": ("poolbench.pooler.gradient_sums", "GradientTee.__call__"),
    "prepare": ("poolbench.pooler.device_pool", "prepare_chunk_pooler"),
    "tables": ("poolbench.pooler.pooled_table", "PooledTableBuilder.add"),
    "head_tables": ("poolbench.pooler.iti", "ITIHeadTableBuilder.add"),
    "sync": ("poolbench.extractor.capture", "sync_device"),
}
PREFIX = "phase:"
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # host blocks


def _annotated(name: str, fn: Callable) -> Callable:
    @wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"{PREFIX}{name}"):
            return fn(*args, **kwargs)

    return inner


@contextmanager
def annotated_phases() -> Iterator[None]:
    """Wrap every phase's function, wherever a poolbench module holds it by name (`from x import f` copies the
    binding), and restore them all on exit."""
    restore: list[tuple[object, str, object]] = []
    try:
        for phase, (module_name, path) in PHASES.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            owner_name, _, attr = path.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            original = getattr(owner, attr)
            wrapped = _annotated(phase, original)
            holders = [owner] if owner_name else [m for name, m in list(sys.modules.items())
                                                  if name.startswith("poolbench") and vars(m).get(attr) is original]
            for holder in holders:
                restore.append((holder, attr, original))
                setattr(holder, attr, wrapped)
        yield
    finally:
        for holder, attr, original in reversed(restore):
            setattr(holder, attr, original)


def profiled_stage(stage: Callable[[], None], device: torch.device, top: int = 25) -> dict:
    """Run `stage` once under the profiler (CUDA activity on a GPU); phases, heaviest ops, launches and waits."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with ExitStack() as stack:
        prof = stack.enter_context(profile(activities=activities))
        stack.enter_context(annotated_phases())
        start = time.perf_counter()
        stage()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    phases = {e.key.removeprefix(PREFIX): {"calls": e.count, "host_ms": e.cpu_time_total / 1e3,
                                           "device_ms": e.device_time_total / 1e3}
              for e in events if e.key.startswith(PREFIX)}
    ops = [e for e in events if not e.key.startswith(PREFIX) and e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type != DeviceType.CPU]  # kernels and copies, on the device's clock

    def row(e) -> dict:
        return {"op": e.key, "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3,
                "self_host_ms": e.self_cpu_time_total / 1e3}

    def heaviest(rows: list, key: Callable) -> list[dict]:
        return [row(e) for e in sorted(rows, key=key, reverse=True)[:top] if key(e) > 0]

    return {
        "wall_s": wall, "device_busy_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "kernel_launches": sum(e.count for e in ops if e.key in LAUNCHES),
        "device_waits": {e.key: e.count for e in ops if e.key in WAITS},
        "phases": phases,
        "top_kernels": heaviest(kernels, lambda e: e.self_device_time_total),
        "top_ops_by_device": heaviest(ops, lambda e: e.self_device_time_total),
        "top_host_ops": heaviest(ops, lambda e: e.self_cpu_time_total),
        "note": "one repeat under torch.profiler (slower than the timed ones); phases include what they call",
    }


def phase_line(profile_result: dict) -> str:
    """The phases in one log line, heaviest device (else host) time first."""
    phases = sorted(profile_result["phases"].items(), key=lambda kv: (kv[1]["device_ms"], kv[1]["host_ms"]),
                    reverse=True)
    parts = [f"{name} {p['host_ms']:.0f}/{p['device_ms']:.0f} ms x{p['calls']}" for name, p in phases]
    return (f"profiled {profile_result['wall_s']:.2f} s, device busy {profile_result['device_busy_ms']:.0f} ms, "
            f"{profile_result['kernel_launches']} launches; host/device: " + ", ".join(parts))
