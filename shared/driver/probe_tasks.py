"""The D1 probe task as Ray runs it: the resources it asks for, and whether one worker process may run several.

Why the second: Ray sets CUDA_VISIBLE_DEVICES for each task it runs, but CUDA reads it once, when a process first
uses the GPU, so a process keeps the GPU of its first probe task. Ray reuses an idle worker process for a later task
and gives that task whichever GPU has room, so on a node with several GPUs a later probe would run on its process's
first GPU instead of the one Ray counted it on, beside another GPU's extractor (a local Ray reporting four GPUs gave
4 of its 8 processes tasks on two different GPUs: bench/README.md, "Probe processes on a node with several GPUs").
Ray's own default for a function declared with GPUs is one task a process (`max_calls=1`); the probe function is
declared without GPUs (they come per call, with the run's share), which turned that default off. So: where a node
has more than one GPU, a probe process runs one task and exits; where every node has at most one, every task on a
node sees the same GPU, and a process serves many tasks (Python, torch and CUDA started once a process, not once a
layer)."""

from __future__ import annotations

from collections.abc import Iterable

import ray
from ray.remote_function import RemoteFunction

from poolbench.prober.concept_probe import probe_layer_task

from .extractor_fleet import probe_gpu_share
from .nodes import Node

PROBE_TASK_RETRIES = 2


def probe_task_resources(on_gpu: bool) -> dict:
    """A D1 task's Ray resources: one core, and on a GPU run a share of a GPU (probe_gpu_share) beside the
    extractor's (EXTRACTOR_GPU_SHARE), so the batched fits (prober.batched_cell) run on the device; without a GPU
    request Ray hides CUDA from the task and its fits would run on one host core."""
    return {"num_cpus": 1, "num_gpus": probe_gpu_share()} if on_gpu else {"num_cpus": 1}


def reuses_probe_processes(on_gpu: bool, nodes: Iterable[Node]) -> bool:
    """Whether a probe process may run several tasks: on CPU always; with GPUs only where no alive node has more
    than one (this module's docstring). Read once a run, from the nodes alive at its start."""
    return not on_gpu or all(node.resources.get("GPU", 0.0) <= 1.0 for node in nodes if node.alive)


def probe_task_function(reuse_processes: bool) -> RemoteFunction:
    """probe_layer_task as a Ray task, its process reused or not (`max_calls` is fixed when the function is
    declared; Ray does not take it per call)."""
    options = {} if reuse_processes else {"max_calls": 1}
    return ray.remote(max_retries=PROBE_TASK_RETRIES, **options)(probe_layer_task)
