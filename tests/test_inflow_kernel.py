"""The attention inflow kernel (extractor/inflow_kernel.py): its values under Triton's interpreter on this CPU
(tests/interpreted_inflow_kernel.py, in a process of its own), its compilation for an H100 (sm_90) by this
machine's Triton, when the capture takes it and when it falls back to the chunked path, and on a GPU its values
against the CPU's float32 maps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from attention_reference import fp32_reference_record
from test_attention_inflow import assert_records_match, route_for, score_scale, synthetic

from poolbench.extractor import attention_capture, attention_inflow, inflow_kernel

TESTS = Path(__file__).parent


def test_the_kernel_equals_the_float32_maps_under_the_interpreter() -> None:
    """tests/interpreted_inflow_kernel.py: every mask form, grouped heads, odd head sizes, three tiles, a real
    model's sdpa and eager layers, fp32 / bf16 / fp16, each through the kernel (counted) within the bound."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", inflow_kernel.ENV: "on"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(TESTS / "interpreted_inflow_kernel.py")], cwd=TESTS.parent, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "20 passed" in done.stdout  # with the check of each dtype, done.stdout[-2000:]


def test_the_kernel_compiles_for_an_h100() -> None:
    """Triton builds every pass and mask form to an sm_90 cubin here, without a GPU: a kernel the interpreter
    runs but the compiler refuses (a tile shape, a type) fails on this CPU, not on a rented H100."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    inflow_kernel._triton()
    kernel = inflow_kernel.compiled_kernel()
    pointers = {"Q": "*bf16", "K": "*bf16", "MASK": "*u8", "REAL": "*u8", "ROW_MAX": "*fp32", "ROW_SUM": "*fp32",
                "OUT": "*fp32"}
    names = kernel.arg_names
    scalars = {name: "i32" for name in names[len(pointers):names.index("scaling")]}
    # every pass with sdpa's bool mask, each other mask form in a pass (a form's code is the same in each pass, ~1 s
    # a build), a float32 model, Gemma's 256-wide heads (32 x 32 tiles)
    cases = [(step, 1, False, "tf32", 128) for step in range(3)] + [(2, 0, False, "tf32", 128)]
    cases += [(1, 2, True, "tf32", 128), (2, 2, False, "ieee", 64), (0, 1, False, "tf32", 256)]  # softcap: Gemma 2
    for step, kind, softcap, precision, head_dim in cases:
        block_m, block_n, block_d = inflow_kernel.block_sizes(head_dim)
        constants = {"PASS": step, "CAUSAL": True, "MASK_KIND": kind, "SOFTCAP": softcap, "PRECISION": precision,
                     "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d}
        types = {**pointers, **scalars, "scaling": "fp32", "softcap": "fp32", **dict.fromkeys(constants, "constexpr")}
        if precision == "ieee":
            types.update(Q="*fp32", K="*fp32", MASK="*fp32")
        source = ASTSource(kernel, types, constexprs={(names.index(k),): v for k, v in constants.items()})
        built = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        assert built.asm["cubin"] and ".target sm_90" in built.asm["ptx"], (step, kind, precision)


def test_the_capture_takes_the_kernel_on_cuda_only_unless_told(monkeypatch) -> None:
    monkeypatch.delenv(inflow_kernel.ENV, raising=False)
    has_triton = inflow_kernel._triton() is not None
    assert inflow_kernel.kernel_wanted(torch.device("cuda")) is has_triton
    assert not inflow_kernel.kernel_wanted(torch.device("cpu"))
    monkeypatch.setenv(inflow_kernel.ENV, "off")
    assert not inflow_kernel.kernel_wanted(torch.device("cuda"))
    monkeypatch.setenv(inflow_kernel.ENV, "on")
    assert inflow_kernel.kernel_wanted(torch.device("cpu")) is has_triton
    monkeypatch.setenv(inflow_kernel.ENV, "yes")
    with pytest.raises(ValueError, match="POOLBENCH_INFLOW_KERNEL='yes': expected one of auto, off, on"):
        inflow_kernel.kernel_wanted(torch.device("cuda"))


def refused_kernel(monkeypatch, caplog, kernel) -> tuple[list, str]:
    """Two layers recorded with `kernel` standing in for the Triton kernel (wanted on this CPU): each record is the
    chunked path's (the float32 maps' within the bound), and what the kernel was asked and the warnings said."""
    monkeypatch.setattr(inflow_kernel, "_FAILED", [])
    monkeypatch.setattr(attention_inflow, "_KERNEL_AGREES", {})
    monkeypatch.setattr(inflow_kernel, "kernel_wanted", lambda device: not inflow_kernel._FAILED)
    asked = []

    def counted(*args, **kwargs):
        asked.append(args[0].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(inflow_kernel, "mean_inflow", counted)
    query, key, real = synthetic(2, 4, 2, 12, 8, torch.float32)
    module = SimpleNamespace(is_causal=True)
    with caplog.at_level(logging.WARNING, logger=inflow_kernel.__name__):
        routes = [route_for(real) for _ in range(2)]
        for route in routes:
            attention_capture._record(route, module, query, key, None, None, {})
    old = route_for(real)
    fp32_reference_record(old, module, query, key, None, None, {})
    for route in routes:
        assert_records_match(route.out[0], old.out[0], score_scale(query, key, {}), 12, 8, "fallback")
    assert len(caplog.records) == 1
    return asked, caplog.text


def test_a_kernel_that_does_not_compile_falls_back_once_with_a_warning(monkeypatch, caplog) -> None:
    """A GPU whose Triton refuses the kernel: the layer is computed in chunks, one warning names the error, and
    the process does not try the kernel again."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    def refuses(*args, **kwargs):
        raise OutOfResources(300_000, 232_448, "shared memory")

    asked, said = refused_kernel(monkeypatch, caplog, refuses)
    # the check's first call (at the records' head size, 8), then never again
    assert asked == [(2, 4, 80, 8)] and "OutOfResources" in said


def test_a_kernel_that_computes_otherwise_is_refused_before_it_records(monkeypatch, caplog) -> None:
    """A kernel that compiles but is off by 1% of the inflow (a GPU or Triton that computes it otherwise; the
    check's bound at the records' head size 8 is 3.7e-4 of the largest inflow on its case, 3.8e-5 of 0.102): the
    check on its seeded case (the records' head size and mask form) finds it beyond the round-off bound, warns once
    with both numbers, and no record comes from it. The chunked path itself passes the check."""
    chunked = attention_inflow.attention_inflow

    def off(query, key, real, scaling, causal, mask, softcap=None):
        rule = attention_inflow.ScoreRule(scaling, softcap, causal, mask)
        return chunked(query, key, real, attention_inflow.last_real_index(real), rule, chunk=7).mean * 1.01

    asked, said = refused_kernel(monkeypatch, caplog, off)
    # the check's case at the records' head size and mask form (none); never a record's (2, 4, 12, 8)
    assert asked == [(2, 4, 80, 8)]
    assert "differs from the chunked path by" in said and "over the round-off bound" in said
    monkeypatch.setattr(attention_inflow, "_KERNEL_AGREES", {})
    monkeypatch.setattr(inflow_kernel, "_FAILED", [])

    def same(query, key, real, scaling, causal, mask, softcap=None):
        rule = attention_inflow.ScoreRule(scaling, softcap, causal, mask)
        return chunked(query, key, real, attention_inflow.last_real_index(real), rule, chunk=7).mean

    monkeypatch.setattr(inflow_kernel, "mean_inflow", same)
    assert attention_inflow.kernel_agrees(torch.device("cpu"), torch.bfloat16) and not inflow_kernel._FAILED
    assert attention_inflow.kernel_agrees(torch.device("cpu"), torch.bfloat16, 2.0) and not inflow_kernel._FAILED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernel_equals_the_float32_maps(monkeypatch, dtype) -> None:
    """Llama-3.1-8B's heads (32 over 8 key heads of 128), 4 x 512 tokens, padded: on CUDA the capture's mean inflow
    comes from the kernel (counted), equal to the CPU's float32 maps within the bound, with and without sdpa's
    bool mask and Gemma 2's softcap; the kernel's launches do not synchronise."""
    monkeypatch.setattr(attention_inflow, "_KERNEL_AGREES", {})  # its checks counted below
    monkeypatch.delenv(inflow_kernel.ENV, raising=False)
    calls = []
    mean_inflow = inflow_kernel.mean_inflow
    monkeypatch.setattr(inflow_kernel, "mean_inflow", lambda *a, **k: calls.append(1) or mean_inflow(*a, **k))
    query, key, real = synthetic(4, 32, 8, 512, 128, dtype, seed=3)
    causal = (torch.ones(512, 512, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    module = SimpleNamespace(is_causal=True)
    for given in (None, causal):
        for kwargs in ({}, {"softcap": 50.0}):  # Gemma-2-9B's attention logit cap
            old, gpu = route_for(real), route_for(real.cuda())
            fp32_reference_record(old, module, query, key, given, None, kwargs)
            attention_capture._record(gpu, module, query.cuda(), key.cuda(),
                                      None if given is None else given.cuda(), None, kwargs)
            on_gpu = {name: value.cpu() for name, value in gpu.out[0].items()}
            assert_records_match(on_gpu, old.out[0], score_scale(query, key, kwargs), 512, 128, f"gpu {dtype}")
    assert len(calls) == 4 + 4 and not inflow_kernel._FAILED  # each record's, and one check a softcap and mask form
    on_device = [tensor.cuda() for tensor in (query, key, real, causal)]  # a pageable copy waits: made before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the kernel's three launches never wait for the device
    try:
        mean_inflow(*on_device[:3], 0.1, True, on_device[3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    on_cuda = query.cuda()  # softcapped or not (d7de13a), the kernel serves keys aligned with the queries only
    assert attention_inflow._kernel_serves(on_cuda, 512) and not attention_inflow._kernel_serves(on_cuda, 513)
