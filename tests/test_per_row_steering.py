"""Per-row steering: rows with different vectors, alphas and layers share one batch and get what each gets in a
batch of its own (layer, delta) (greedy and sampled); row chunking by rows and tokens; the batched perplexity
equals one-at-a-time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from poolbench.extractor.loading import load_model
from poolbench.steerer.backend import Generation, GenerationSettings, generate_by_delta
from poolbench.steerer.measures import continuation_nll
from poolbench.steerer.run import prompt_seeds
from poolbench.steerer.transformers_backend import prompt_group_chunks, row_chunks
from poolbench.steerer.worker import SteeringWorker

PROMPTS = ["the cat sat on", "a dog", "birds sang in the trees near the river", "near the park the"]


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: Path) -> SteeringWorker:
    return SteeringWorker(load_model(str(tiny_llama_dir), device="cpu"))


@pytest.fixture(scope="module")
def layered(layered_llama_dir: Path) -> SteeringWorker:
    return SteeringWorker(load_model(str(layered_llama_dir), device="cpu"))


def _deltas(d: int) -> list[np.ndarray | None]:
    rng = np.random.default_rng(3)
    u, v = (rng.normal(size=d).astype(np.float32) for _ in range(2))
    return [None, 4.0 * u / np.linalg.norm(u), 9.0 * v / np.linalg.norm(v)]


@pytest.mark.parametrize("greedy", [True, False])
def test_mixed_batch_equals_one_delta_per_batch(worker, greedy):
    settings = GenerationSettings(max_new_tokens=6, greedy=greedy)
    deltas = _deltas(worker.loaded.hidden_size)
    seeds = prompt_seeds(len(PROMPTS), 5)
    alone = {k: worker.generate(PROMPTS, layer=0, delta=d, seeds=seeds, settings=settings)
             for k, d in enumerate(deltas)}
    # Interleaved: every batch row sits beside rows of the other deltas, in an order no per-delta batch has.
    order = [(k, i) for i in reversed(range(len(PROMPTS))) for k in (2, 0, 1)]
    mixed = worker.generate_rows([PROMPTS[i] for _, i in order], layer=0, deltas=[deltas[k] for k, _ in order],
                                 seeds=[seeds[i] for _, i in order], settings=settings)
    for (k, i), g in zip(order, mixed, strict=True):
        assert g.token_ids == alone[k][i].token_ids and g.text == alone[k][i].text
        assert g.prompt_ids == alone[k][i].prompt_ids
    # The deltas do steer (so the equality above could fail): each steered row differs from the unsteered one.
    for k in (1, 2):
        assert [g.token_ids for g in alone[k]] != [g.token_ids for g in alone[0]]


@pytest.mark.parametrize("greedy", [True, False])
def test_mixed_layer_batch_equals_one_layer_per_batch(layered, greedy):
    """Rows steering at layer 0, at layer 1 and not at all in one call get what each gets in a call of its own
    (layer, delta); the same delta at the other layer is another row, so a backend that ignored the per-row layer
    fails here."""
    settings = GenerationSettings(max_new_tokens=6, greedy=greedy)
    _, u, v = _deltas(layered.loaded.hidden_size)
    kinds = [(0, None), (0, u), (1, u), (1, v)]  # (layer, delta)
    seeds = prompt_seeds(len(PROMPTS), 2)
    alone = [layered.generate(PROMPTS, layer=layer, delta=d, seeds=seeds, settings=settings) for layer, d in kinds]
    order = [(k, i) for i in range(len(PROMPTS)) for k in (3, 1, 0, 2)]
    mixed = layered.generate_rows([PROMPTS[i] for _, i in order], layer=[kinds[k][0] for k, _ in order],
                                 deltas=[kinds[k][1] for k, _ in order], seeds=[seeds[i] for _, i in order],
                                 settings=settings)
    for (k, i), g in zip(order, mixed, strict=True):
        assert g.token_ids == alone[k][i].token_ids and g.text == alone[k][i].text, (k, i)
    tokens = [[g.token_ids for g in gens] for gens in alone]
    assert tokens[1] != tokens[0] and tokens[3] != tokens[0]  # each layer's delta steers ...
    assert tokens[1] != tokens[2]  # ... and u at layer 0 is not u at layer 1


def test_a_row_layer_out_of_range_or_a_layer_list_of_the_wrong_length_is_one_line(worker):
    from poolbench.steerer.errors import SteeringError

    settings = GenerationSettings(max_new_tokens=2)
    with pytest.raises(SteeringError, match=r"layer 2 out of range for .* \(2 layers\)"):
        worker.generate_rows(PROMPTS[:2], layer=[0, 2], deltas=[None, None], seeds=[0, 1], settings=settings)
    with pytest.raises(SteeringError, match="2 prompts but 3 layers"):
        worker.generate_rows(PROMPTS[:2], layer=[0, 1, 1], deltas=[None, None], seeds=[0, 1], settings=settings)


def test_rows_beyond_the_budget_go_in_further_batches_with_the_same_answers(worker):
    settings = GenerationSettings(max_new_tokens=5)
    deltas = _deltas(worker.loaded.hidden_size)
    rows = [p for p in PROMPTS for _ in deltas]
    row_deltas = [d for _ in PROMPTS for d in deltas]
    seeds = list(range(len(rows)))
    one = worker.generate_rows(rows, layer=1, deltas=row_deltas, seeds=seeds, settings=settings)
    small = GenerationSettings(max_new_tokens=5, batch_size=5, token_budget=60)
    many = worker.generate_rows(rows, layer=1, deltas=row_deltas, seeds=seeds, settings=small)
    assert [g.token_ids for g in many] == [g.token_ids for g in one]


def test_row_chunks_by_rows_and_tokens():
    # widths 3, 5, 2, 9 with 4 new tokens: (3+4)=7, 2*(5+4)=18, 3*(5+4)=27 > 20 -> cut; 2, then 2*(9+4)=26 > 20.
    assert row_chunks([3, 5, 2, 9], 4, 10, 20) == [range(0, 2), range(2, 3), range(3, 4)]
    assert row_chunks([3, 5, 2, 9], 4, 2, 1000) == [range(0, 2), range(2, 4)]
    assert row_chunks([30], 4, 8, 20) == [range(0, 1)]  # one row over the budget still runs
    assert row_chunks([], 4, 8, 20) == []


def test_a_delta_of_the_wrong_size_is_one_line(worker):
    from poolbench.steerer.errors import SteeringError

    d = worker.loaded.hidden_size
    with pytest.raises(SteeringError, match=f"row 1 has width 3 \\(shape \\(3,\\)\\), the model's hidden size is {d}"):
        worker.generate_rows(PROMPTS[:2], layer=0, deltas=[None, np.ones(3, np.float32)], seeds=[0, 1],
                             settings=GenerationSettings(max_new_tokens=2))


@pytest.mark.parametrize(("scale", "msg"), [(np.inf, "row 0 is not finite"), (np.nan, "row 0 is not finite"),
                                            (1e308, "row 0 is not finite"),
                                            (1e19, "row 0 has norm 5.66e\\+19, over 1.84e\\+19")])
def test_a_delta_the_dtype_cannot_carry_is_one_line(worker, scale, msg):
    """fp32 model: 1e308 overflows the float64 product's cast; 1e19 x 32 ones has norm 5.66e19 > sqrt(fp32 max)."""
    from poolbench.steerer.errors import SteeringError

    with np.errstate(over="ignore", invalid="ignore"):
        delta = (scale * np.ones(worker.loaded.hidden_size)).astype(np.float32)
    with pytest.raises(SteeringError, match=msg) as err:
        worker.generate_rows(PROMPTS[:1], layer=0, deltas=[delta], seeds=[0],
                             settings=GenerationSettings(max_new_tokens=2))
    assert "\n" not in str(err.value)


def test_rows_of_one_prompt_share_a_chunk_and_only_an_oversized_group_splits():
    ids = [[1, 2], [3, 4, 5], [1, 2], [3, 4, 5], [6], [1, 2]]  # prompts A B A B C A
    assert prompt_group_chunks(ids, 2, 100, 1000) == [[0, 2, 5, 1, 3, 4]]
    # 4 rows at most: A's three rows, then B's two with C (a group never straddles chunks).
    assert prompt_group_chunks(ids, 2, 4, 1000) == [[0, 2, 5], [1, 3, 4]]
    # Token budget 12: A (3 x (2 + 2) = 12) fills a chunk; B (2 x 5 = 10) and C would make 3 x 5 = 15.
    assert prompt_group_chunks(ids, 2, 100, 12) == [[0, 2, 5], [1, 3], [4]]
    # A group over the limits on its own is the only one split, into consecutive pieces.
    assert prompt_group_chunks(ids, 2, 2, 1000) == [[0, 2], [5], [1, 3], [4]]


def test_one_delta_per_call_backends_group_rows_and_keep_row_order():
    calls = []

    class OneDelta:
        def generate(self, prompts, *, layer, delta, seeds, settings, prompt_format="auto"):
            calls.append((list(prompts), None if delta is None else float(delta[0]), list(seeds)))
            return [Generation(p, f"{p}@{None if delta is None else float(delta[0])}", (), ()) for p in prompts]

    a, b = np.full(2, 1.0, np.float32), np.full(2, 2.0, np.float32)
    out = generate_by_delta(OneDelta(), ["p", "q", "r", "s"], layer=0,  # type: ignore[arg-type]
                            deltas=[a, None, a.copy(), b], seeds=[0, 1, 2, 3], settings=GenerationSettings())
    assert [g.text for g in out] == ["p@1.0", "q@None", "r@1.0", "s@2.0"]
    assert calls == [(["p", "r"], 1.0, [0, 2]), (["q"], None, [1]), (["s"], 2.0, [3])]
    # One layer per row: a delta at two layers is two calls; unsteered rows go in one call whatever their layer.
    calls.clear()
    out = generate_by_delta(OneDelta(), ["p", "q", "r", "s"], layer=[0, 1, 1, 2],  # type: ignore[arg-type]
                            deltas=[a, a, None, None], seeds=[0, 1, 2, 3], settings=GenerationSettings())
    assert [g.text for g in out] == ["p@1.0", "q@1.0", "r@None", "s@None"]
    assert calls == [(["p"], 1.0, [0]), (["q"], 1.0, [1]), (["r", "s"], None, [2, 3])]


def _nll_alone(loaded, g: Generation) -> float:
    """The reference: one unpadded sequence, full logits, summed -log p of the continuation tokens."""
    ids = torch.tensor([list(g.prompt_ids) + list(g.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(input_ids=ids).logits[0].double(), dim=-1)
    p = len(g.prompt_ids)
    return float(-sum(logp[p - 1 + j, t] for j, t in enumerate(g.token_ids)))


def test_batched_perplexity_equals_one_sequence_at_a_time(worker):
    gens = worker.generate_rows(PROMPTS, layer=0, deltas=[None] * 4, seeds=[0, 1, 2, 3],
                                settings=GenerationSettings(max_new_tokens=6, min_new_tokens=0))
    # Continuations of different lengths (one cut to 2 tokens, one empty) in one left-padded batch.
    gens = [gens[0], Generation(gens[1].prompt, "", gens[1].prompt_ids, gens[1].token_ids[:2]),
            Generation(gens[2].prompt, "", gens[2].prompt_ids, ()), gens[3]]
    nll, n_tok = continuation_nll(worker.loaded, gens)
    assert n_tok.tolist() == [len(gens[0].token_ids), 2, 0, len(gens[3].token_ids)]
    expected = [_nll_alone(worker.loaded, g) for g in gens]
    assert expected[2] == 0.0 and expected[1] > 0
    assert nll == pytest.approx(expected, rel=1e-5, abs=1e-5)
    one_by_one, _ = continuation_nll(worker.loaded, gens, token_budget=1)
    assert one_by_one == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_generation_progress_counts_every_sampled_token(worker, monkeypatch):
    from poolbench.records.events import CellProgress
    from poolbench.steerer.transformers_backend import GenerationProgress

    seen: list[tuple[int, int]] = []
    step = GenerationProgress.step

    def recording(self, rows: int) -> None:
        step(self, rows)
        seen.append((self.rows_done, self.tokens_done))

    monkeypatch.setattr(GenerationProgress, "step", recording)
    settings = GenerationSettings(max_new_tokens=4, min_new_tokens=4, greedy=True, batch_size=2)
    prompts = [*PROMPTS, "one more prompt"]  # 5 rows in chunks of 2, 2, 1
    worker.generate_rows(prompts, layer=0, deltas=[None] * 5, seeds=prompt_seeds(5, 0), settings=settings)
    # one call per sampled token step, counting the chunk's rows; each chunk ends at rows_done x 4 tokens
    assert seen == [(0, 2), (0, 4), (0, 6), (0, 8), (2, 10), (2, 12), (2, 14), (2, 16),
                    (4, 17), (4, 18), (4, 19), (4, 20)]
    assert worker.backend.progress is None  # a display of the call in flight only
    assert CellProgress("c", "A1_mean", 1, 25, 100, 10.0).eta_s == pytest.approx(30.0)
    assert CellProgress("c", "A1_mean", 1, 0, 100, 1.0).eta_s is None
