"""Inside vLLM's engine processes (named as the engine's `worker_cls`): the steering op in every decoder layer,
put there before vLLM traces and compiles the model, so compiled graphs (and CUDA graphs) keep it.

`poolbench::steer(hidden, layer)` returns `hidden + tables[layer][index[:n]]` and adds one to `counts[layer]`:
tables [layers, slots, d], the per-token slot index and the counts are allocated once at model load and only ever
written in place, so a traced or captured graph reads the values of the current call. Slot 0 is the zero row,
for unsteered requests and padding. See docs/vllm-steering.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

CONFIG_KEY = "poolbench_steering"  # in vllm_config.additional_config: {"slots": N}; part of vLLM's config hash
OP_NAMESPACE = "poolbench"
SLOT_ARG = "poolbench_slot"
# A CPU engine's warm-up ("to generate the graph for the generic shape") is vLLM's memory-profiling forward over
# max_num_batched_tokens dummy tokens: 16,384 here (vllm_engine.CPU_BATCHED_TOKENS), ~4.4 TFLOP of SmolLM2 and
# 35-45 s of an idle 2-core machine's engine start, beside D1's tail in make run. The graph it compiles is the
# same from a smaller step in the same compile range, and the CPU engine's KV cache is sized explicitly, not from
# that forward's peak: so a CPU engine warms up on this many tokens (make run's generations compared equal, table
# for table; bench/README.md).
CPU_WARM_UP_TOKENS = 1024
WARM_UP_ATTR = "poolbench_warm_up_tokens"


@dataclass
class SteeringBuffers:
    """One worker's fixed-address steering state, and what the current call's steps did."""

    tables: torch.Tensor  # [layers, slots, d] in the model's dtype; row 0 of every layer stays zero
    index: torch.Tensor  # [max_num_tokens] int64 on the device: each token's slot, zero past the step's tokens
    staging: torch.Tensor  # the index's host copy (pinned on a GPU): written by the host, copied without a sync
    counts: torch.Tensor  # [layers] int64 on the device: forwards each layer's op ran since the call began
    used_rows: int = 1  # table rows the latest call wrote (zeroed by the next)
    last_tokens: int = 0  # index entries the latest step set (zeroed by the next)
    steps: int = 0  # steps prepared since the call began
    step_tokens: int = 0  # the call's latest step's tokens (0 before its first)
    problems: list[str] = field(default_factory=list)
    original_prepare: Any = None

    def note(self, problem: str) -> None:
        if problem not in self.problems and len(self.problems) < 8:
            self.problems.append(problem)


BUFFERS: SteeringBuffers | None = None


def steer(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """Each token's slot row of `layer`'s table added to the layer's output; counted on the device."""
    buffers = BUFFERS
    if buffers is None:
        raise RuntimeError("poolbench::steer ran in a vLLM worker without steering buffers")
    buffers.counts[layer] += 1
    n = hidden.shape[0]
    if n < buffers.step_tokens:  # host-side, so seen in eager and compiled runs, not in a CUDA graph's replay
        buffers.note(f"the op at layer {layer} saw a forward of {n} tokens in a step of {buffers.step_tokens}: "
                     "vLLM split the step (micro-batching), so the slot index cannot line up")
    # embedding's gather is ~10x index_select's on CPU (2.5 vs 30 ms for 4,000 x 576 floats); the sum is the same
    return torch.nn.functional.embedding(buffers.index[:n], buffers.tables[layer]).add_(hidden)


def steer_fake(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden)


def register_op() -> None:
    """Register `poolbench::steer` once per process (vLLM's low-overhead registration, its own library)."""
    if hasattr(torch.ops, OP_NAMESPACE) and hasattr(getattr(torch.ops, OP_NAMESPACE), "steer"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op  # pyright: ignore[reportMissingImports]

    global _LIBRARY
    _LIBRARY = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
    direct_register_custom_op("steer", steer, fake_impl=steer_fake, target_lib=_LIBRARY)


_LIBRARY: Any = None


def steer_output(layer: int, _module, _args, output):
    """Forward hook on decoder layer `layer`: vLLM layers return (hidden, residual) and fuse the residual add into
    the next norm, so adding to `hidden` adds to the residual stream."""
    op = getattr(torch.ops, OP_NAMESPACE).steer
    if isinstance(output, tuple):
        return (op(output[0], layer), *output[1:])
    return op(output, layer)


def request_slot(request) -> int:
    """The slot a running request asked for in its sampling params (0: unsteered)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    return int(extra.get(SLOT_ARG, 0))


def prepare_with_slots(buffers: SteeringBuffers, runner, scheduler_output, *args, **kwargs):
    """The runner's own input preparation, then the step's token -> slot index in batch order (execute_model
    flattens input_batch.req_ids, each with its num_scheduled_tokens), written in place: the host copy, then one
    non-blocking copy (vLLM's synchronize_input_prep around this keeps the host copy until the last one is done)."""
    out = buffers.original_prepare(scheduler_output, *args, **kwargs)
    req_ids = list(runner.input_batch.req_ids)
    scheduled = scheduler_output.num_scheduled_tokens
    if len(req_ids) != len(scheduled) or any(r not in scheduled for r in req_ids):
        buffers.note(f"the batch holds {len(req_ids)} requests but {len(scheduled)} were scheduled: "
                     "input_batch.req_ids is not the step's batch")
        req_ids = []
    counts = np.fromiter((scheduled[r] for r in req_ids), np.int64, len(req_ids))
    slots = np.fromiter((request_slot(runner.requests[r]) for r in req_ids), np.int64, len(req_ids))
    rows = buffers.tables.shape[1]
    if len(slots) and (slots.min() < 0 or slots.max() >= rows):
        buffers.note(f"a request names slot {int(slots.max())} but the tables have {rows} rows")
        slots[:] = 0
    n = int(counts.sum())
    if n > buffers.index.numel():
        buffers.note(f"a step of {n} tokens is longer than the slot index ({buffers.index.numel()})")
        n = 0
    end = max(n, buffers.last_tokens)
    staging = buffers.staging.numpy()
    staging[:n] = np.repeat(slots, counts)[:n]
    staging[n:end] = 0
    if buffers.index.data_ptr() != buffers.staging.data_ptr():
        buffers.index[:end].copy_(buffers.staging[:end], non_blocking=True)
    buffers.last_tokens = buffers.step_tokens = n
    buffers.steps += 1
    return out


STATE_ATTR = "_poolbench_steering"


def install(runner, slots: int) -> None:
    """Allocate the buffers, hook every decoder layer and wrap the runner's input preparation: before vLLM's
    first forward, which is where it traces and compiles the model."""
    global BUFFERS  # the op's: one model per vLLM worker process
    register_op()
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise RuntimeError(f"vLLM model {type(model).__name__} has no .model.layers to steer")
    param = next(model.parameters())
    tokens = int(runner.max_num_tokens)
    device = param.device
    staging = torch.zeros(tokens, dtype=torch.int64, pin_memory=device.type == "cuda")
    index = staging if device.type == "cpu" else torch.zeros(tokens, dtype=torch.int64, device=device)
    hidden = int(runner.model_config.get_hidden_size())
    BUFFERS = SteeringBuffers(
        tables=torch.zeros(len(layers), slots, hidden, dtype=param.dtype, device=device), index=index,
        staging=staging, counts=torch.zeros(len(layers), dtype=torch.int64, device=device))
    for i, layer in enumerate(layers):
        if hasattr(layer, "register_forward_hook"):  # pipeline ranks hold placeholders for others' layers
            layer.register_forward_hook(functools.partial(steer_output, i))
    BUFFERS.original_prepare = runner._prepare_inputs
    runner._prepare_inputs = functools.partial(prepare_with_slots, BUFFERS, runner)
    setattr(runner, STATE_ATTR, BUFFERS)


def warm_up_tokens(runner, cap: int = CPU_WARM_UP_TOKENS) -> int:
    """The warm-up step's tokens: `cap`, but inside the compile range that holds the engine's largest step (vLLM
    compiles a graph per range), so the warm-up compiles the graph the full-size step compiled."""
    top = int(runner.max_num_tokens)
    endpoints = getattr(runner.compilation_config, "compile_ranges_endpoints", None) or []
    lower = max([int(e) + 1 for e in endpoints if int(e) < top], default=1)
    return min(top, max(lower, cap))


def small_warm_up(runner, warm_up) -> None:
    """Run the runner's own warm-up with its step size cut to warm_up_tokens for the call, and note the size."""
    saved = runner.max_num_tokens
    runner.max_num_tokens = warm_up_tokens(runner)
    try:
        warm_up()
        setattr(runner, WARM_UP_ATTR, runner.max_num_tokens)
    finally:
        runner.max_num_tokens = saved


def warm_up_report(worker) -> int | None:
    """The tokens this worker's warm-up ran (None where it kept vLLM's own, as a GPU worker does)."""
    return getattr(worker.model_runner, WARM_UP_ATTR, None)


def set_tables(tables: dict[int, tuple[bytes, tuple[int, int]]], worker) -> bool:
    """The call's rows into the tables, in place (float32 bytes and shape per steered layer; the latest call's
    rows zeroed first, row 0 never written), and the call's counts started afresh."""
    buffers: SteeringBuffers | None = getattr(worker.model_runner, STATE_ATTR, None)
    if buffers is None:
        return False
    buffers.tables[:, 1:buffers.used_rows].zero_()
    used = 1
    for layer, (data, shape) in tables.items():
        rows = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
        buffers.tables[layer, 1:shape[0]].copy_(rows[1:], non_blocking=True)
        used = max(used, int(shape[0]))
    buffers.used_rows = used
    buffers.counts.zero_()
    buffers.steps = buffers.step_tokens = 0
    buffers.problems = []
    return True


def steering_report(worker) -> dict | None:
    """What this worker's steps did in the call (plain values for the trip back), None without buffers."""
    buffers: SteeringBuffers | None = getattr(worker.model_runner, STATE_ATTR, None)
    if buffers is None:
        return None
    return {"steps": buffers.steps, "counts": buffers.counts.tolist(), "problems": list(buffers.problems)}


def steering_info(worker) -> str:
    """Why this worker cannot steer (empty when it can): checked once, when the engine has started."""
    if getattr(worker.model_runner, STATE_ATTR, None) is None:
        return ("no steering buffers: vLLM did not run PoolBench's worker class (worker_cls), so the model has no "
                "steering op")
    if not isinstance(worker.model_runner._prepare_inputs, functools.partial):
        return "the model runner's input preparation is not the backend's (a V2 runner, or replaced)"
    return ""


class _SteeredWorker:
    """Mixed in before vLLM's own worker class: the steering goes in right after the weights are loaded."""

    vllm_config: Any
    model_runner: Any

    warm_up_small: bool = False  # the CPU worker's (see CPU_WARM_UP_TOKENS); a GPU's warm-up sizes its memory

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]
        settings = (self.vllm_config.additional_config or {}).get(CONFIG_KEY) or {}
        install(self.model_runner, int(settings.get("slots", 128)))
        runner = self.model_runner
        if self.warm_up_small and hasattr(runner, "warming_up_model"):
            runner.warming_up_model = functools.partial(small_warm_up, runner, runner.warming_up_model)


def __getattr__(name: str):
    """SteeredCPUWorker / SteeredGPUWorker, built on first use so that only the device's own worker is imported."""
    if name == "SteeredCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker  # pyright: ignore[reportMissingImports]

        base, extra = CPUWorker, {"warm_up_small": True}
    elif name == "SteeredGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker  # pyright: ignore[reportMissingImports]

        base, extra = Worker, {}
    else:
        raise AttributeError(name)
    cls = type(name, (_SteeredWorker, base), {"__module__": __name__, **extra})
    globals()[name] = cls
    return cls
