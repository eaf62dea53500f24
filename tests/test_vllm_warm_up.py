"""A CPU engine's warm-up on a small step: its size (inside the compile range of the engine's largest step), the
runner's own warm-up run with it and the step size put back, and only the CPU worker doing so (the live engine's
size: test_vllm_live.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poolbench.steerer import vllm_worker
from poolbench.steerer.vllm_worker import CPU_WARM_UP_TOKENS, small_warm_up, warm_up_report, warm_up_tokens


def _runner(max_num_tokens: int, endpoints: list[int] | None) -> SimpleNamespace:
    return SimpleNamespace(max_num_tokens=max_num_tokens,
                           compilation_config=SimpleNamespace(compile_ranges_endpoints=endpoints))


@pytest.mark.parametrize("max_num_tokens, endpoints, want", [
    (16384, None, CPU_WARM_UP_TOKENS),  # no ranges: the cap
    (16384, [16384], CPU_WARM_UP_TOKENS),  # one range [1, 16384]: vLLM's own endpoint at the largest step
    (16384, [2048, 16384], 2049),  # the largest step's range starts past the cap: its first size
    (16384, [512, 16384], CPU_WARM_UP_TOKENS),  # ... or below it
    (600, [600], 600),  # an engine whose steps are smaller than the cap keeps its own
])
def test_the_warm_up_step_stays_in_the_largest_step_s_compile_range(max_num_tokens, endpoints, want):
    assert warm_up_tokens(_runner(max_num_tokens, endpoints)) == want


def test_the_runner_s_own_warm_up_runs_on_the_small_step_and_the_size_comes_back():
    runner = _runner(16384, [2048, 16384])
    seen: list[int] = []
    small_warm_up(runner, lambda: seen.append(runner.max_num_tokens))
    assert seen == [2049] and runner.max_num_tokens == 16384
    assert warm_up_report(SimpleNamespace(model_runner=runner)) == 2049

    def fails() -> None:
        raise RuntimeError("warm-up failed")

    other = _runner(16384, None)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        small_warm_up(other, fails)
    assert other.max_num_tokens == 16384 and warm_up_report(SimpleNamespace(model_runner=other)) is None


def test_only_the_cpu_worker_warms_up_small():
    cpu = pytest.importorskip("vllm.v1.worker.cpu_worker")
    assert issubclass(vllm_worker.SteeredCPUWorker, cpu.CPUWorker)
    assert vllm_worker.SteeredCPUWorker.warm_up_small is True
    assert vllm_worker._SteeredWorker.warm_up_small is False  # the GPU worker's class attribute, without importing it
