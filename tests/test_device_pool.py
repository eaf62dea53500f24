"""Pooling on the model's device inside the capture (DevicePooler) against its numpy reference twin (pool_tokens
on a host ActivationBatch), for every registered strategy, on CPU and (marked gpu) on CUDA.

Tolerances: the two paths pool the same float32 token states and differ only in summation order, so they agree to
float32 round-off of weighted means over T tokens (and S2_sif_pc1's projection over the D dimensions) of the
largest token value (tests/tolerances.py). The device path fed bfloat16 states is compared with the reference fed
the same states cast to float32: max/min of bfloat16 values are those of their float32 casts (exact), norms reduce in
float32, and the weighted sums are float32 GEMMs of the cast states on CPU. On CUDA they read the bfloat16 states as
they are (device_pool.weighted_sums): the float32 weights split exactly into three bfloat16 parts (8 + 8 + 8
significant bits), every product of two bfloat16 numbers is exact in float32 and the GEMM accumulates in float32,
so the high part's sum rounds as the float32 product does, the middle and low parts' sums round at 2^-8 and 2^-16 of
that scale, and adding the three results is 2 roundings more: the bound's n grows by 2 there (BF16_PARTS)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from pooled_bounds import assert_same_tables
from test_pool_strategies import parsed_batch
from tolerances import assert_float32_close, assert_weighted_mean_close

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.layer_sinks import stack_layer_extras
from poolbench.extractor.padded_batches import PaddedBatch
from poolbench.pooler.device_pool import DevicePooler, HostPooler, chunk_pooler
from poolbench.pooler.iti import head_vectors
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.registry import list_strategies
from poolbench.pooler.sink import sink_rows
from poolbench.pooler.spec import StrategySpec, TokenContext
from poolbench.pooler.windows import window_spec

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
LAYER_NAMES = ("attention_head_inflow", "attention_head_inflow_last", "attention_head_output_last",
               "gradient_norm", "gradient_x_input")


def every_strategy(parse: bool) -> list[StrategySpec]:
    """Every registered strategy (variants included) that this batch can serve, plus other window sizes and the
    other sink modes of the sink-aware ones."""
    specs = [s for s in list_strategies(include_reference=True) if ("parse" in s.needs) == parse
             and "tokens" not in s.needs]  # L4_subword_root reads a tokenizer: tests/test_reference_variants.py
    if not parse:
        specs += [window_spec("W1", k=3), window_spec("W3", k=5), window_spec("W4", n_chunks=3)]
        specs += [s.with_sink_mode(mode) for s in specs if s.sink_mode == "auto" for mode in ("skip", "keep")]
    unique: dict[tuple, StrategySpec] = {}
    for spec in specs:
        unique.setdefault((spec.id, spec.params), spec)
    # one batch pools each id once: the sink-mode variants get their own ids
    out = []
    for spec in unique.values():
        if any(o.id == spec.id for o in out):
            spec = replace(spec, id=f"{spec.code}_{spec.sink_mode}_{len(out)}")
        out.append(spec)
    return out


def sinky_batch(seed: int, n_layers: int = 3, batch: int = 7, length: int = 20, dim: int = 6,
                heads: int = 4) -> ActivationBatch:
    """Random token states and per-layer extras, padding on both sides, and a massive first token (norm and
    attention sink) in some passages at some layers, so every branch of the sink rule runs."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n_layers, batch, length, dim)).astype(np.float32) * 3
    mask = np.zeros((batch, length), dtype=bool)
    lengths = rng.integers(1, length + 1, batch)
    lengths[:4] = (1, length, 2, 3)
    for b, n in enumerate(lengths):
        if b % 2:
            mask[b, length - n:] = True
        else:
            mask[b, :n] = True
    first = mask.argmax(axis=1)
    rows = np.arange(batch)
    hidden[1:, rows[1::2], first[1::2]] *= 40.0  # a norm sink at layers 1-2 in odd passages
    inflow = rng.random((n_layers, batch, heads, length)).astype(np.float32)
    inflow[2, rows[::2], :, first[::2]] += 30.0  # an attention sink at layer 2 in even passages
    inflow_last = rng.random((n_layers, batch, heads, length)).astype(np.float32)
    inflow_last[0, rows, :, first] += 50.0
    extras = {
        "attention_head_inflow": np.where(mask[None, :, None], inflow, 0).astype(np.float32),
        "attention_head_inflow_last": np.where(mask[None, :, None], inflow_last, 0).astype(np.float32),
        "attention_head_output_last": rng.standard_normal((n_layers, batch, heads, 3)).astype(np.float32),
        "gradient_norm": rng.random((n_layers, batch, length)).astype(np.float32),
        "gradient_x_input": rng.random((n_layers, batch, length)).astype(np.float32),
        "unigram_probability": rng.random((batch, length)) * 1e-2,
    }
    extras["gradient_norm"][:, 3] = 0.0  # a passage whose S2 weights are all zero: falls back to A1
    special = np.zeros_like(mask)
    special[rows, first] = True
    return ActivationBatch(
        passage_ids=[f"p{b}" for b in range(batch)], texts=["some text"] * batch, layers=tuple(range(n_layers)),
        hidden=hidden, attention_mask=mask, input_ids=rng.integers(0, 50, (batch, length)),
        offsets=np.zeros((batch, length, 2), dtype=np.int32), special_mask=special, extras=extras)


def run_device(batch: ActivationBatch, specs: list[StrategySpec], device: str,
               dtype: torch.dtype = torch.float32) -> DevicePooler:
    """Feed a DevicePooler layer by layer as the capture does: token states and that layer's extras on device."""
    chunk = PaddedBatch(list(range(len(batch.passage_ids))), batch.passage_ids, batch.texts, batch.input_ids,
                        batch.attention_mask, batch.offsets, batch.special_mask)
    host = {k: v for k, v in batch.extras.items() if k not in LAYER_NAMES and not k.startswith("attention_")}
    pooler = DevicePooler(specs, chunk, batch.layers, host, torch.device(device))
    for i, layer in enumerate(batch.layers):
        extras = {k: torch.from_numpy(batch.extras[k][i]).to(device) for k in LAYER_NAMES if k in batch.extras}
        pooler(layer, torch.from_numpy(batch.hidden[i]).to(device=device, dtype=dtype), extras)
    pooler.finish()
    return pooler


def reference(batch: ActivationBatch, specs: list[StrategySpec]):
    """The numpy twin, with the [L, ...] extras (and S1's head means) stacked as HostCapture stacks them."""
    per_layer = [{k: torch.from_numpy(batch.extras[k][i]) for k in LAYER_NAMES if k in batch.extras}
                 for i in range(len(batch.layers))]
    stacked = {**{k: v for k, v in batch.extras.items() if k not in LAYER_NAMES}, **stack_layer_extras(per_layer)}
    host = ActivationBatch(**{**batch.__dict__, "extras": stacked})
    heads = head_vectors(host) if "attention_head_output_last" in stacked else None
    return pool_tokens(host, specs), heads


BF16_PARTS = 2  # roundings added by summing the three bfloat16 parts' products on CUDA (module docstring)


def assert_same(device: DevicePooler, batch: ActivationBatch, specs: list[StrategySpec], more_terms: int = 0) -> None:
    expected, heads = reference(batch, specs)
    assert device.pooled is not None
    assert device.pooled.strategy_ids == expected.strategy_ids and device.pooled.layers == expected.layers
    real = batch.hidden[:, batch.attention_mask]
    n = batch.hidden.shape[2] + batch.hidden.shape[3] + more_terms  # T tokens, a projection over D (S2_sif_pc1)
    for s, spec in enumerate(specs):
        assert_weighted_mean_close(device.pooled.vectors[:, s], expected.vectors[:, s], real, n, err_msg=spec.id)
    np.testing.assert_array_equal(device.pooled.fallback, expected.fallback)
    if heads is not None:
        assert device.heads is not None
        assert_float32_close(device.heads[0], heads[0], terms=batch.hidden.shape[2] + more_terms)  # meaned over T
        np.testing.assert_array_equal(device.heads[1], heads[1])


@pytest.mark.numerics
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_device_pooling_equals_numpy_pooling_for_every_strategy(device: str, seed: int) -> None:
    batch = sinky_batch(seed)
    specs = every_strategy(parse=False)
    assert {"A1", "A2", "A3", "A4", "P1", "P2", "P3", "W1", "W2", "W3", "W4", "S1", "S2", "S3"} <= {
        s.code for s in specs}
    # the batch does exercise the sink rule: some passages drop their first token at some layer, not all
    norms = TokenContext.from_batch(batch).token_norms
    dropped = sink_rows(norms, batch.attention_mask, "auto")
    assert dropped.any() and not dropped.all()
    assert_same(run_device(batch, specs, device), batch, specs)


@pytest.mark.numerics
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("left", [False, True])
def test_device_pooling_equals_numpy_pooling_for_linguistic_strategies(device: str, left: bool) -> None:
    batch = parsed_batch(left)
    specs = every_strategy(parse=True)
    assert {s.code for s in specs} >= {"L1", "L2", "L3", "L4", "L5", "L6"}
    assert_same(run_device(batch, specs, device), batch, specs)


@pytest.mark.numerics
@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_states_pool_as_their_float32_cast(device: str) -> None:
    batch = sinky_batch(7)
    specs = every_strategy(parse=False)
    pooled = run_device(batch, specs, device, dtype=torch.bfloat16)
    cast = torch.from_numpy(batch.hidden).to(torch.bfloat16).float().numpy()
    assert not np.array_equal(cast, batch.hidden)  # the cast does round: the comparison is not vacuous
    assert_same(pooled, ActivationBatch(**{**batch.__dict__, "hidden": cast}), specs,
                BF16_PARTS if device == "cuda" else 0)


def test_a_rule_that_reads_token_states_pools_on_the_host() -> None:
    """A plugin weight rule using ctx.hidden cannot run before the forward: that chunk takes the reference way."""
    spec = StrategySpec(id="X1_first_dim", code="X1", family="other", kind="weights",
                        description="weights from the first hidden dimension, squared",
                        weights_fn=lambda ctx: np.asarray(ctx.hidden)[0, :, :, 0] ** 2)
    batch = sinky_batch(1)
    chunk = PaddedBatch(list(range(7)), batch.passage_ids, batch.texts, batch.input_ids, batch.attention_mask,
                        batch.offsets, batch.special_mask)
    assert isinstance(chunk_pooler([spec], chunk, batch.layers, {}, torch.device("cpu")), HostPooler)
    host = {"unigram_probability": batch.extras["unigram_probability"]}
    assert isinstance(chunk_pooler(every_strategy(parse=False), chunk, batch.layers, host, torch.device("cpu")),
                      DevicePooler)


def test_negative_layer_weights_are_refused_after_the_forward() -> None:
    batch = sinky_batch(2)
    batch.extras["gradient_norm"][1, 2, 0] = -1.0
    spec = next(s for s in list_strategies() if s.id == "S2_gradient")
    with pytest.raises(StrategyError, match=r"'S2_gradient': weights must be finite and non-negative"):
        run_device(batch, [spec], "cpu")


def test_a_concept_pools_and_probes_the_same_on_the_device_as_the_reference_way(tiny_llama_dir) -> None:
    """The run's path end to end on the tiny Llama: every card strategy (parses, corpus statistics, attention,
    gradients, S3 heads) pooled inside the capture vs the numpy hand-off, then D1 on both tables."""
    from negation_pairs import passages

    from poolbench.extractor.loading import load_model
    from poolbench.pooler.concept_pooling import pool_concept_tables
    from poolbench.prober.concept_probe import probe_pooled_table

    loaded = load_model(str(tiny_llama_dir))
    data = passages(12, "train") + passages(6, "test")
    specs = list_strategies()
    new, old = (pool_concept_tables(loaded, data, [0, 1], specs, batch_size=8, max_length=64, device_pooling=flag)
                for flag in (True, False))
    for layer in (0, 1):
        a, b = new.layers[layer], old.layers[layer]
        assert a.column("strategy").to_pylist() == b.column("strategy").to_pylist()
        assert a.column("fallback").to_pylist() == b.column("fallback").to_pylist()
        x, y = (np.stack(t.column("vector").to_numpy(zero_copy_only=False)) for t in (a, b))
        # The same token states pooled two ways: round-off of <= 64 tokens and a projection over D = 32, of the
        # largest token value, which A2_max and A3_min put in the table (max |x| over it is max |state|).
        assert_float32_close(x, y, terms=64 + 32 + 2, scale=float(np.abs(y).max()))
    d1 = [probe_pooled_table(out.pooled, "negation", n_folds=3, n_bootstrap=20, reliability=False, heads=out.heads)
          for out in (new, old)]
    assert len(d1[0]) == len(d1[1]) > 0
    assert max(abs(x.test_auroc - y.test_auroc) for x, y in zip(*d1, strict=True)) <= 1e-6


class OutOfMemoryAbove(torch.nn.Module):
    """A model wrapper that raises torch.OutOfMemoryError when a forward holds more than `limit` padded tokens."""

    def __init__(self, model: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self.inner, self.limit, self.config, self.sizes = model, limit, model.config, []

    def forward(self, input_ids, attention_mask, **kwargs):
        self.sizes.append(input_ids.shape[0])
        if input_ids.numel() > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunk_that_runs_out_of_memory_halves_and_a_passage_too_big_alone_is_skipped(tiny_llama_dir,
                                                                                       overlap) -> None:
    """Also with the next chunk prepared ahead: the chunk that failed was prepared (ahead) for itself, and its
    halves are each prepared anew, never handed the failed chunk's preparation."""
    from poolbench.extractor.capture import capture_chunks
    from poolbench.extractor.extraction_stats import ExtractionStats
    from poolbench.extractor.loading import load_model
    from poolbench.extractor.padded_batches import prepare_batches
    from poolbench.pooler.device_pool import prepare_chunk_pooler

    loaded = load_model(str(tiny_llama_dir))
    texts = ["a short one", "another short text", "tiny", "word " * 30]
    batches = prepare_batches(loaded.tokenizer, texts, ids=["s1", "s2", "s3", "long"], batch_size=4,
                              max_tokens=100)
    assert [b.passage_ids for b in batches] == [["long"], ["s2", "s1", "s3"]]
    long_tokens, short = (b.input_ids.shape[1] for b in batches)
    wrapped = OutOfMemoryAbove(loaded.model, limit=2 * short)  # two short rows fit, three do not, `long` never
    stats = ExtractionStats()
    prepared: list[PaddedBatch] = []

    def prepare(chunk: PaddedBatch):
        prepared.append(chunk)
        return prepare_chunk_pooler([list_strategies()[0]], chunk, [1], {}, torch.device("cpu"))

    out = list(capture_chunks(wrapped, loaded.decoder_layers, batches, [1], stats=stats, max_batch_tokens=4096,
                              prepare_for=prepare, overlap=overlap))
    pooled_ids = [pid for chunk, _ in out for pid in chunk.passage_ids]
    assert sorted(pooled_ids) == ["s1", "s2", "s3"]
    assert stats.skipped == [("long", long_tokens)] and stats.skipped_indices == [3]
    assert wrapped.sizes == [1, 3, 1, 2]  # `long` alone fails; three short rows halve to one and two
    assert [chunk.passage_ids for chunk, _ in out] == [["s2"], ["s1", "s3"]]
    assert [c.passage_ids for c in prepared] == [["long"], ["s2", "s1", "s3"], ["s2"], ["s1", "s3"]]
    assert all(isinstance(sink, DevicePooler) and sink.chunk is chunk for chunk, sink in out)
    # with overlap the first chunk (`long`) is prepared beside its own forward, which fails, so the three-row chunk
    # is prepared at once after it; its second half is prepared ahead (and `long`'s preparation is never used)
    assert stats.prepared_ahead == (1 if overlap else 0)


class OutOfMemoryAboveLlama(OutOfMemoryAbove):
    """OutOfMemoryAbove with the inner Llama's own forward arguments, so the capture passes position ids."""

    def forward(self, input_ids, attention_mask, position_ids=None, use_cache=None, output_hidden_states=None):
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        return super().forward(input_ids, attention_mask, use_cache=use_cache,
                               output_hidden_states=output_hidden_states, **kwargs)


@pytest.mark.numerics  # halved chunks against whole ones: bounded, and run on each kernel set
def test_a_concept_group_that_runs_out_of_memory_pools_the_same_tables_with_overlap(tiny_llama_dir) -> None:
    """Every strategy, chunks halved after injected out-of-memory errors, the next chunk prepared ahead: the
    tables hold the undisturbed ones' rows, and their vectors within the forward's round-off (halves keep the padded
    length, but a GEMM of fewer rows may block otherwise: tests/pooled_bounds.py)."""
    from dataclasses import replace

    from negation_pairs import passages

    from poolbench.extractor.loading import load_model
    from poolbench.pooler.concept_pooling import ConceptPassages, pool_concept_group

    loaded = load_model(str(tiny_llama_dir))
    specs = list_strategies()
    members = [ConceptPassages("negation", passages(8, "train") + passages(4, "test")),
               ConceptPassages("other", [replace(p, concept="other", text=p.text.upper())
                                         for p in passages(5, "train") + passages(2, "test")])]
    budget = 16 * 64  # whole batches, whatever the default, so that only the injected errors halve them
    calm = pool_concept_group(loaded, members, [0, 1], specs, batch_size=16, max_length=64, overlap=False,
                              max_batch_tokens=budget)
    wrapped = OutOfMemoryAboveLlama(loaded.model, limit=5 * 12)
    stormy = pool_concept_group(replace(loaded, model=wrapped), members, [0, 1], specs, batch_size=16,
                                max_length=64, overlap=True, max_batch_tokens=budget)
    assert any(a > b for a, b in zip(wrapped.sizes, wrapped.sizes[1:], strict=False))  # some chunk was halved
    for a, b in zip(calm, stormy, strict=True):
        for layer in (0, 1):
            assert_same_tables(b.layers[layer], a.layers[layer], f"layer {layer}")
            assert a.layer_heads is not None and b.layer_heads is not None
            assert_same_tables(b.layer_heads[layer], a.layer_heads[layer], f"heads layer {layer}")


class CudaErrorAt(OutOfMemoryAbove):
    def forward(self, input_ids, attention_mask, **kwargs):
        raise RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA")


def test_a_cuda_error_names_the_stage_and_batch_in_one_line(tiny_llama_dir) -> None:
    from poolbench.errors import ExtractionError
    from poolbench.extractor.capture import capture_chunks
    from poolbench.extractor.loading import load_model
    from poolbench.extractor.padded_batches import prepare_batches

    loaded = load_model(str(tiny_llama_dir))
    batches = prepare_batches(loaded.tokenizer, ["one text", "two texts here"], ids=["a", "b"], batch_size=4)
    with pytest.raises(ExtractionError) as error:
        list(capture_chunks(CudaErrorAt(loaded.model, 0), loaded.decoder_layers, batches, [0],
                            sink_for=lambda chunk: HostPooler([list_strategies()[0]], chunk, [0], {})))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("CUDA error in the capture (forward and pooling) of batch 0 (2 passages from 'b'")
    assert message.endswith("CUDA error: device-side assert triggered")
