"""The vLLM backend without vLLM: a stand-in engine cloudpickles every payload the backend sends (as vLLM's
collective_rpc does across processes) and runs it on a CPU stand-in worker whose scheduler flattens requests in
its own order, so the test sees each token's added vector: every request gets its own delta and no other's."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from poolbench.steerer import vllm_backend
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.errors import SteeringError
from poolbench.steerer.vllm_backend import SLOT_ARG, STATE_ATTR, VLLMBackend

D, LAYERS = 8, 3


class Layer(torch.nn.Module):
    """A vLLM-style decoder layer: (hidden, residual) in and out, here the identity."""

    def forward(self, hidden, residual):
        return hidden, residual


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, n_tokens: int) -> torch.Tensor:
        hidden, residual = torch.zeros(n_tokens, D), torch.zeros(n_tokens, D)
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual


class Runner:
    def __init__(self) -> None:
        self.model = Model()
        self.requests: dict = {}
        self.input_batch = SimpleNamespace(req_ids=[])
        self.max_num_tokens = 8192
        self.compilation_config = SimpleNamespace(mode=SimpleNamespace(name="NONE"),
                                                  cudagraph_mode=SimpleNamespace(name="NONE"))

    def get_model(self):
        return self.model

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        return "prepared"


class Engine:
    """Records every payload, ships it through cloudpickle and runs it on the worker; generate() schedules a
    prefill step and one-token decode steps, the batch order reversed on odd steps."""

    def __init__(self, tokenizer) -> None:
        self.worker = SimpleNamespace(model_runner=Runner())
        self.tokenizer = tokenizer
        self.payloads: list = []
        self.seen: dict[int, list[torch.Tensor]] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, args=(), kwargs=None):
        self.payloads.append(method)
        shipped = cloudpickle.loads(cloudpickle.dumps(method))
        return [shipped(self.worker, *args, **(kwargs or {}))]

    def generate(self, prompts, params, use_tqdm=True):
        runner = self.worker.model_runner
        ids = [f"req-{i}" for i in range(len(prompts))]
        runner.requests = {r: SimpleNamespace(sampling_params=p) for r, p in zip(ids, params, strict=True)}
        self.seen = {i: [] for i in range(len(prompts))}
        for step in range(params[0].max_tokens):
            order = list(reversed(range(len(ids)))) if step % 2 else list(range(len(ids)))
            runner.input_batch.req_ids = [ids[i] for i in order]
            counts = [len(prompts[i]["prompt_token_ids"]) if step == 0 else 1 for i in order]
            assert runner._prepare_inputs(SimpleNamespace(num_scheduled_tokens={
                ids[i]: n for i, n in zip(order, counts, strict=True)}), np.array(counts)) == "prepared"
            out = runner.get_model()(sum(counts))
            for i, part in zip(order, torch.split(out, counts), strict=True):
                self.seen[i].extend(part)
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=[SimpleNamespace(text="", token_ids=(1,) * params[0].max_tokens)])
                for p in prompts]


class Params:
    """vllm.SamplingParams' keyword interface."""

    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)


@pytest.fixture
def backend(tiny_llama_dir: Path) -> VLLMBackend:
    engine = Engine(AutoTokenizer.from_pretrained(tiny_llama_dir))
    b = VLLMBackend.__new__(VLLMBackend)
    b.setup(engine, Params, SimpleNamespace(hidden_size=D, num_hidden_layers=LAYERS), torch.float32)
    return b


def _is_module_level(fn) -> bool:
    return inspect.isfunction(fn) and fn.__qualname__ == fn.__name__ and \
        getattr(vllm_backend, fn.__name__, None) is fn


def test_every_payload_is_a_module_function_on_plain_values_and_pickles(backend):
    rng = np.random.default_rng(0)
    deltas = [None, rng.normal(size=D), rng.normal(size=D)]
    settings = GenerationSettings(max_new_tokens=3, greedy=True)
    backend.generate_rows(["a b", "c", "d e f"], layer=1, deltas=deltas, seeds=[0, 1, 2], settings=settings)
    backend.generate(["a"], layer=2, delta=None, seeds=[0], settings=settings)
    backend.close()
    payloads = backend.llm.payloads
    assert len(payloads) == 4  # install L1, tables; tables (nothing steers at L2, so no hook there); remove
    for p in payloads:
        fn = p.func if isinstance(p, functools.partial) else p
        assert _is_module_level(fn), fn
        args = (*p.args, *p.keywords.values()) if isinstance(p, functools.partial) else ()
        assert all(isinstance(a, (int, dict)) for a in args), args
        shipped = cloudpickle.loads(cloudpickle.dumps(p))
        assert (shipped.func if isinstance(p, functools.partial) else shipped) is fn  # by reference, no closure
    runner = backend.llm.worker.model_runner
    assert not hasattr(runner, STATE_ATTR) and "_prepare_inputs" not in vars(runner)
    assert all(not layer._forward_hooks for layer in runner.model.model.layers)


def test_an_alpha_grid_in_one_call_steers_each_request_with_its_own_delta(backend):
    rng = np.random.default_rng(1)
    unit = rng.normal(size=D).astype(np.float32)
    other = rng.normal(size=D).astype(np.float32)
    alphas = [0.0, 0.5, 1.0, 2.0]
    prompts = ["the cat sat", "a dog", "birds sang in the trees"]
    rows = [(a, p) for a in alphas for p in prompts] + [(1.0, "a dog")]
    deltas = [None if a == 0 else (a * unit).astype(np.float32) for a, _ in rows[:-1]] + [other]
    settings = GenerationSettings(max_new_tokens=4, greedy=True)
    gens = backend.generate_rows([p for _, p in rows], layer=1, deltas=deltas, seeds=list(range(len(rows))),
                                 settings=settings)
    assert len(gens) == len(rows) and len(backend.llm.payloads) == 2  # one install, one table: one engine call
    for i, delta in enumerate(deltas):
        seen = torch.stack(backend.llm.seen[i]).numpy()
        want = np.zeros(D, np.float32) if delta is None else delta
        np.testing.assert_allclose(seen, np.broadcast_to(want, seen.shape), rtol=1e-6, atol=1e-6)
    # The requests named their slots; equal deltas (none here but the zeros) share slot 0.
    slots = [r.sampling_params.extra_args[SLOT_ARG] for r in backend.llm.worker.model_runner.requests.values()]
    assert slots[:len(prompts)] == [0] * len(prompts) and len(set(slots)) == 1 + 3 + 1


def test_an_unsteered_call_after_a_steered_one_adds_nothing(backend):
    settings = GenerationSettings(max_new_tokens=2, greedy=True)
    backend.generate(["a b"], layer=0, delta=np.ones(D, np.float32), seeds=[0], settings=settings)
    backend.generate(["a b"], layer=0, delta=None, seeds=[0], settings=settings)
    assert all(float(t.abs().sum()) == 0 for t in backend.llm.seen[0])


def test_rows_steering_at_different_layers_share_one_call(backend):
    """Two layers' vectors in one engine call: each row's delta is added once, at its own layer only."""
    rng = np.random.default_rng(2)
    u, v = (rng.normal(size=D).astype(np.float32) for _ in range(2))
    layers, deltas = [0, 2, 2, 0], [u, v, None, v]
    backend.generate_rows(["a", "b c", "d", "e"], layer=layers, deltas=deltas, seeds=[0, 1, 2, 3],
                          settings=GenerationSettings(max_new_tokens=2, greedy=True))
    assert len(backend.llm.payloads) == 3  # install L0, install L2, tables
    for i, delta in enumerate(deltas):
        want = np.zeros(D, np.float32) if delta is None else delta
        for t in backend.llm.seen[i]:
            np.testing.assert_allclose(t.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("delta", "msg"), [
    (np.ones(3), f"row 0 has width 3 \\(shape \\(3,\\)\\), the model's hidden size is {D}"),
    (np.full(D, np.inf), "row 0 is not finite"),
    (np.full(D, 1e30), "row 0 has norm 2.83e\\+30, over 1.84e\\+19"),
])
def test_bad_deltas_are_one_line_before_anything_reaches_the_engine(backend, delta, msg):
    with pytest.raises(SteeringError, match=msg):
        backend.generate(["a"], layer=0, delta=delta, seeds=[0], settings=GenerationSettings(max_new_tokens=1))
    assert backend.llm.payloads == []


def _without_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")


def test_missing_vllm_is_one_line_before_any_work(tmp_path):
    """Driver run, single-cell steer, the HTTP app and cluster up: the install hint, and nothing started."""
    from poolbench.cluster.launcher import cluster_up
    from poolbench.config import RunConfig
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.http.app import ServiceSettings, build_api
    from poolbench.steerer.single_cell import steer_one_cell

    _without_vllm()
    hint = r"^the vLLM backend needs vLLM \(a GPU machine\): pip install 'poolbench\[gpu\]'$"
    with pytest.raises(SteeringError, match=hint):
        run_benchmark(RunConfig(backend="vllm", out=str(tmp_path / "run"), store=str(tmp_path / "store")))
    with pytest.raises(SteeringError, match=hint):
        steer_one_cell("praise", "A1_mean", 0, model="tiny", corpus="embedded", corpus_size="small",
                       store_url=str(tmp_path / "store"), backend="vllm")
    with pytest.raises(SteeringError, match=hint):
        build_api(ServiceSettings(steering_backend="vllm"))
    with pytest.raises(SteeringError, match=hint):
        cluster_up(state=tmp_path / "cluster", steering_backend="vllm")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_step_without_input_preparation_runs_unsteered(backend):
    """vLLM's dummy runs call the model without preparing inputs: the hook must not fail on a stale index."""
    settings = GenerationSettings(max_new_tokens=1, greedy=True)
    backend.generate(["a b"], layer=0, delta=np.ones(D, np.float32), seeds=[0], settings=settings)
    runner = backend.llm.worker.model_runner
    n = getattr(runner, STATE_ATTR).index.numel() + 5
    assert float(runner.get_model()(n)[-5:].abs().sum()) == 0


def test_the_engine_gets_the_v1_model_runner_and_pickled_payloads(monkeypatch):
    env: dict[str, str] = {}
    vllm_backend.engine_environment(env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    with pytest.raises(SteeringError, match=r"^VLLM_USE_V2_MODEL_RUNNER=1 selects vLLM's model runner V2") as err:
        vllm_backend.engine_environment({"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert "\n" not in str(err.value)
    with pytest.raises(SteeringError, match=r"^VLLM_ALLOW_INSECURE_SERIALIZATION=0 stops"):
        vllm_backend.engine_environment({"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"})


def test_a_runner_the_hooks_cannot_steer_is_one_line_at_install(backend):
    """Model runner V2 (vllm/v1/worker/gpu/model_runner.py) has no _prepare_inputs/input_batch/requests, and a
    compiled model never calls hooks added after start-up: both refused before any generation."""
    v2 = SimpleNamespace(model=Model(), prepare_inputs=lambda *a: None, req_states=None, max_num_tokens=64)
    backend.llm.worker.model_runner = v2
    with pytest.raises(SteeringError, match=r"^vLLM's model runner .* has no _prepare_inputs: the steering backend "
                                            "hooks the V1 GPU model runner") as err:
        backend.generate(["a"], layer=0, delta=np.ones(D), seeds=[0], settings=GenerationSettings(max_new_tokens=1))
    assert "\n" not in str(err.value) and backend.installed == set()
    runner = Runner()
    runner.compilation_config.mode = SimpleNamespace(name="VLLM_COMPILE")
    backend.llm.worker.model_runner = runner
    with pytest.raises(SteeringError, match=r"compilation_config\.mode=VLLM_COMPILE: hooks added after start-up"):
        backend.generate(["a"], layer=0, delta=np.ones(D), seeds=[0], settings=GenerationSettings(max_new_tokens=1))
    assert not hasattr(runner, STATE_ATTR) and not runner.model.model.layers[0]._forward_hooks
