"""Chunked attention inflow (S1, S3) against the full float32 recomputation it replaced, kept here as the reference,
on the same q/k/mask the models hand their attention (GQA, softcap, sliding windows, left and right padding, bool
and additive masks, fp32 and bf16), and its largest temporary O(chunk × T), never T × T.

Bound (tests/tolerances.py's widths): both paths form each score s = scaling·Σ_i q_i k_i from the same inputs with
exact products (bf16 × bf16 fits float32's significand; in float32 one rounding each) summed in float32 in other
orders, so |Δs| <= k·eps·S·√Dh with S = scaling·Σ_i |q_i k_i| (the operands' magnitude); a softcap c·tanh(s/c) has
slope <= 1 and adds roundings of size <= c. A softmax p_k moves by p_k·(Δs_k - Σ_j p_j Δs_j), at most 2·max|Δs|
as p <= 1, plus its own Tk roundings of scale 1; the mean over <= Tq queries adds Tq roundings of scale 1. Hence
|Δ| <= k·eps·(1 + 2(S + c))·√(Dh + Tk + Tq), assert_float32_close's form with that scale and those terms.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from attention_reference import fp32_reference_record
from tiny_models import random_llama
from tolerances import assert_float32_close
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM

from poolbench.extractor import attention_capture, attention_inflow, inflow_kernel
from poolbench.extractor.attention_capture import _Route, capture_attention, last_real_index


def score_scale(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> float:
    """1 + 2(S + c) of the bound above, S = scaling·max Σ_i |q_i k_i| over heads, queries and keys (float64)."""
    q = query.double().abs()
    k = key.double().abs().repeat_interleave(q.shape[1] // key.shape[1], dim=1)
    scaling = kwargs.get("scaling") or q.shape[-1] ** -0.5
    return 1.0 + 2.0 * (scaling * float((q @ k.transpose(-1, -2)).max()) + float(kwargs.get("softcap") or 0.0))


def assert_records_match(new: dict, old: dict, scale: float, n_q: int, head_dim: int, what: str) -> None:
    n_k = old["inflow"].shape[-1]
    for name in ("inflow", "inflow_last"):
        assert new[name].dtype == torch.float32 and new[name].shape == old[name].shape
        assert_float32_close(new[name], old[name], scale=scale, terms=head_dim + n_k + n_q, err_msg=f"{what} {name}")
    if "head_output_last" in old:
        assert torch.equal(new["head_output_last"], old["head_output_last"])


def compared_capture(monkeypatch, budget: int) -> list:
    """Patch the capture so each requested layer runs the chunked and the reference recomputation on its inputs."""
    monkeypatch.setattr(attention_inflow, "CHUNK_BUDGET_BYTES", budget)
    seen = []

    def both(route, module, query, key, attention_mask, output, kwargs):
        old = _Route(route.layer, route.query_mask, route.last_index, route.head_outputs, {})
        fp32_reference_record(old, module, query, key, attention_mask, output, kwargs)
        attention_capture_record(route, module, query, key, attention_mask, output, kwargs)
        seen.append((route.out[route.layer], old.out[route.layer], score_scale(query, key, kwargs),
                     query.shape[2], query.shape[3], attention_mask))

    attention_capture_record = attention_capture._record
    monkeypatch.setattr(attention_capture, "_record", both)
    return seen


def gemma2(dtype: torch.dtype) -> Gemma2ForCausalLM:
    """Gemma 2 in miniature: GQA, logits softcapped at 2 (so the cap bites), a 4-token sliding window on every
    other layer, scaling from query_pre_attn_scalar rather than the head size."""
    torch.manual_seed(0)
    config = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, intermediate_size=64, vocab_size=50, sliding_window=4,
                          attn_logit_softcapping=2.0, query_pre_attn_scalar=16, max_position_embeddings=64)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    return model.to(dtype).requires_grad_(False)


MODELS = {"llama": lambda dtype: random_llama().to(dtype), "gemma2": gemma2}


def real_model_records(monkeypatch, name: str, dtype) -> tuple[list, int]:
    """Every layer of MODELS[name] run through sdpa and eager attention (their own masks: bool, additive), 3 rows
    of 12 tokens with left and right padding, 5 queries a chunk (3 chunks, a partial one): compared_capture's
    (record, float32 maps' record, scale, Tq, Dh, mask) per layer and implementation, and the model's layers."""
    model = MODELS[name](dtype)
    layers = model.model.layers
    ids = torch.randint(3, 50, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    mask[2, 8:] = False  # right padding
    seen = compared_capture(monkeypatch, budget=14 * 3 * 4 * 12 * 5)
    for impl in ("sdpa", "eager"):
        model.config._attn_implementation = impl
        with capture_attention(model, layers, range(len(layers)), mask, head_outputs=True), torch.no_grad():
            model(input_ids=ids, attention_mask=mask.long(), position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0))
    return seen, len(layers)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunked_inflow_equals_the_float32_maps_in_real_models(monkeypatch, name: str, dtype) -> None:
    seen, n_layers = real_model_records(monkeypatch, name, dtype)
    masks = {type(m).__name__ if m is None else str(m.dtype) for *_, m in seen}
    assert len(seen) == 2 * n_layers and masks >= {"torch.bool", str(dtype)}  # sdpa's bool, eager's additive
    for new, old, scale, n_q, head_dim, _ in seen:
        assert_records_match(new, old, scale, n_q, head_dim, f"{name} {dtype}")
        assert float(new["inflow"][1, :, :5].abs().max()) == 0  # padding keys receive nothing
        # each real query's row sums to 1 up to its softmax's and this sum's Tk roundings, the mean's Tq (scale 1)
        assert_float32_close(new["inflow"].sum(-1), torch.ones(3, 4), scale=1.0, terms=2 * n_q + n_q)


def synthetic(batch: int, heads: int, kv_heads: int, length: int, head_dim: int, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, length, head_dim, generator=generator).to(dtype)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, : length // 3] = False
    mask[-1, length - length // 4:] = False
    return query, key, mask


def route_for(mask: torch.Tensor) -> _Route:
    return _Route(0, mask, last_real_index(mask), False, {})


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("given", ["none", "padding-2d", "window-bool", "window-float", "bidirectional"])
def test_chunked_record_equals_the_reference_for_every_mask_form(monkeypatch, given: str, dtype) -> None:
    """Flash's padding-only 2-D mask and sdpa's is_causal (no mask) keep the causal rule; a sliding window comes in
    the mask, as bools or additive; an encoder attends both ways. Rows fully masked (a window over padding) give 0."""
    monkeypatch.setattr(attention_inflow, "CHUNK_BUDGET_BYTES", 14 * 2 * 6 * 40 * 7)  # 7 queries a chunk
    query, key, real = synthetic(2, 6, 2, 40, 16, dtype)
    index = torch.arange(40)
    window = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - 5)
    masks = {"none": None, "padding-2d": real.long(), "window-bool": window[None, None],
             "window-float": torch.zeros(40, 40, dtype=dtype).masked_fill(~window, float("-inf"))[None, None],
             "bidirectional": None}
    module = SimpleNamespace(is_causal=given != "bidirectional")
    kwargs = {"scaling": 0.3, "softcap": 3.0} if given == "window-float" else {}
    new, old = route_for(real), route_for(real)
    attention_capture._record(new, module, query, key, masks[given], None, kwargs)
    fp32_reference_record(old, module, query, key, masks[given], None, kwargs)
    assert_records_match(new.out[0], old.out[0], score_scale(query, key, kwargs), 40, 16, given)
    if given.startswith("window"):  # the first 13 queries of row 0 see only padding keys
        assert float(new.out[0]["inflow"][0, :, :13].abs().max()) == 0


@pytest.mark.numerics
def test_a_passage_of_padding_alone_receives_and_gives_nothing() -> None:
    query, key, real = synthetic(2, 4, 2, 9, 8, torch.float32)
    real[1] = False
    route = route_for(real)
    attention_capture._record(route, SimpleNamespace(is_causal=True), query, key, None, None, {})
    assert float(route.out[0]["inflow"][1].abs().max()) == 0 and float(route.out[0]["inflow_last"][1].abs().max()) == 0
    assert_float32_close(route.out[0]["inflow_last"][0].sum(-1), torch.ones(4), scale=1.0, terms=2 * 9)


class LargestNewTensor(TorchDispatchMode):
    """The largest storage an op allocates (outputs that are views of its inputs are not new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("given", ["none", "bool-4d"])
def test_largest_temporary_is_a_query_chunk_not_the_whole_map(monkeypatch, given: str) -> None:
    batch, heads, length, chunk = 2, 4, 768, 48
    monkeypatch.setattr(attention_inflow, "CHUNK_BUDGET_BYTES", 14 * batch * heads * length * chunk)
    assert attention_inflow.query_chunk(batch, heads, length, length) == chunk
    query, key, real = synthetic(batch, heads, 2, length, 16, torch.float32)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = None if given == "none" else (causal[None] & real[:, None, :])[:, None]
    module = SimpleNamespace(is_causal=True)
    sizes = {}
    for name, record in (("chunked", attention_capture._record), ("reference", fp32_reference_record)):
        with LargestNewTensor() as meter, torch.no_grad():
            record(route_for(real), module, query, key, mask, None, {})
        sizes[name] = meter.largest
    assert sizes["reference"] >= batch * heads * length * length * 4  # the meter sees the old path's T × T map
    assert sizes["chunked"] <= batch * heads * chunk * length * 4  # one chunk's float32 scores, T/16 of the map


class ScoreElements(TorchDispatchMode):
    """Elements of every q·k product (bmm) the recomputation forms: its score work."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.bmm:
            self.elements += out.numel()
        return out


@pytest.mark.numerics
@pytest.mark.parametrize("given", ["bool-4d", "float-4d"])
def test_a_causal_mask_stops_each_chunk_at_its_last_query(monkeypatch, given: str) -> None:
    """sdpa's padded causal mask (bool) and eager's (dtype's lowest value where blocked): a chunk's scores stop at
    its last query's key, ~(1 + 1/chunks)/2 of the T × T map, and the record stays the reference's within the
    bound. Restoring the full width (trimming only without a mask, as before) computes the whole map."""
    batch, heads, length, chunk = 3, 4, 96, 12
    monkeypatch.setattr(attention_inflow, "CHUNK_BUDGET_BYTES", 14 * batch * heads * length * chunk)
    query, key, real = synthetic(batch, heads, 2, length, 16, torch.float32, seed=5)
    causal = (torch.ones(length, length, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]
    mask = causal if given == "bool-4d" else \
        torch.zeros(causal.shape).masked_fill(~causal, torch.finfo(torch.float32).min)
    module = SimpleNamespace(is_causal=True)
    new, old = route_for(real), route_for(real)
    with ScoreElements() as counted, torch.no_grad():
        attention_capture._record(new, module, query, key, mask, None, {})
    fp32_reference_record(old, module, query, key, mask, None, {})
    assert_records_match(new.out[0], old.out[0], score_scale(query, key, {}), length, 16, given)
    chunks = length // chunk
    per_map = batch * heads * length * length
    rows_last = batch * heads * length  # the last real query's row, computed on its own
    assert counted.elements == per_map * (chunks + 1) // (2 * chunks) + rows_last
    [(layer, _, flag)] = new.later_keys.values()
    assert layer == 0 and not bool(flag)


@pytest.mark.parametrize("form", ["bool", "float"])
def test_a_mask_that_lets_a_query_see_a_later_key_is_told(form: str) -> None:
    """later_keys_allowed: a causal mask is not, one opening a single later key to a real query is; a later key
    seen only from a padding query (sdpa unmasks padding rows that see nothing) is not counted."""
    length = 10
    real = torch.ones(2, length, dtype=torch.bool)
    real[1, :4] = False
    causal = (torch.ones(length, length, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]

    def as_form(mask: torch.Tensor) -> torch.Tensor:
        return mask if form == "bool" else torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))

    assert not bool(attention_inflow.later_keys_allowed(as_form(causal), real, length, length))
    padding_row = causal.clone()
    padding_row[1, 0, 2, :] = True  # query 2 of row 1 is padding
    assert not bool(attention_inflow.later_keys_allowed(as_form(padding_row), real, length, length))
    opened = causal.clone()
    opened[1, 0, 6, 8] = True  # a real query sees a later key
    assert bool(attention_inflow.later_keys_allowed(as_form(opened), real, length, length))


def test_capture_refuses_a_causal_model_handed_a_mask_open_to_later_keys() -> None:
    """A 4-D mask of the caller's own that lets every query see every key, in a model whose layers say causal: the
    trimmed inflow would drop what later keys receive, so the capture stops naming the layer."""
    model = random_llama()
    model.config._attn_implementation = "sdpa"
    layers = model.model.layers
    ids = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(4))
    real = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(attention_capture.AttentionCaptureError, match=r"layer 1: .*later key"), torch.no_grad(), \
            capture_attention(model, layers, [1, 2], real):
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))
    with capture_attention(model, layers, [1, 2], real) as out, torch.no_grad():  # its own causal mask: fine
        model(input_ids=ids, attention_mask=real.long())
    assert sorted(out) == [1, 2]


def test_memory_model_is_linear_in_the_chunk_not_quadratic_in_length() -> None:
    per_row = attention_inflow.recompute_bytes_per_row
    assert per_row(32, 8, 128, 512, 64) - per_row(32, 8, 128, 512, 32) == 32 * 32 * (14 * 512 + 4 * 128)
    per_token = attention_inflow.recompute_bytes_per_token(32, 8, 128)
    assert per_row(32, 8, 128, 1024, 1) == 14 * 32 * 1024 + 4 * 32 * 128 + 1024 * per_token
    assert attention_inflow.query_chunk(16, 32, 512, 512) == 256 * 2**20 // (14 * 16 * 32 * 512)
    assert attention_inflow.query_chunk(1, 1, 8, 8) == 8 and attention_inflow.query_chunk(10**6, 64, 8, 8) == 1
    assert attention_inflow.chunk_budget("cuda") == 256 * 2**20 and attention_inflow.chunk_budget("cpu") == 32 * 2**20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_chunked_inflow_equals_its_cpu_twin(monkeypatch, dtype) -> None:
    """On CUDA the bf16 scores come from a float32-output product: the same exact products, other sums. The
    chunked path is the kernel's fallback there (tests/test_inflow_kernel.py tests the kernel), so it is forced."""
    monkeypatch.setenv(inflow_kernel.ENV, "off")
    query, key, real = synthetic(4, 32, 8, 512, 128, dtype, seed=3)
    index = torch.arange(512)
    mask = ((index[None, :] <= index[:, None])[None] & real[:, None, :])[:, None]
    module = SimpleNamespace(is_causal=True)
    for given in (None, mask):
        cpu, gpu = route_for(real), route_for(real.cuda())
        attention_capture._record(cpu, module, query, key, given, None, {})
        attention_capture._record(gpu, module, query.cuda(), key.cuda(), None if given is None else given.cuda(),
                                  None, {})
        torch.cuda.synchronize()
        on_gpu = {name: value.cpu() for name, value in gpu.out[0].items()}
        assert_records_match(on_gpu, cpu.out[0], score_scale(query, key, {}), 512, 128, f"gpu {dtype}")
    assert not bool(attention_inflow.later_keys_allowed(mask.cuda(), real.cuda(), 512, 512))
    assert bool(attention_inflow.later_keys_allowed(torch.ones_like(mask).cuda(), real.cuda(), 512, 512))
