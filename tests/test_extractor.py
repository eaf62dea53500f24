"""Extractor core on tiny models built from configs: hook points, batch plans, ActivationBatch output."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tolerances import assert_float32_close
from torch import nn
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.corpus.passage import Passage
from poolbench.errors import ExtractionError
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.batching import plan_batches
from poolbench.extractor.extract import extract_activations, extract_batches
from poolbench.extractor.extraction_stats import ExtractionStats
from poolbench.extractor.forward_baselines import forward_only
from poolbench.extractor.hook_points import HookPointError, add_hooks, capture_layer_outputs
from poolbench.extractor.padded_batches import prepare_batches

CORPUS = [
    "The cat sat on the mat.",
    "A dog barked at the mailman, loudly and often!",
    "Quantum fields fluctuate in the vacuum.",
    "hi",
    "Rivers carve canyons over millions of years.",
    "She sold sea shells by the sea shore.",
]
TEXTS = [*CORPUS, "The mat sat on the cat", "Loudly, the rivers sang."]
# Roundings along the test Llama's forward: 3 layers, each summing over 32 hidden, 64 MLP and the positions (< 64).
CHAIN_TERMS = 3 * (32 + 64 + 64)


def n_hooks(module: nn.Module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE like Llama 3 / GPT-2 with a template that prepends <s>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def llama(bpe_tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, vocab_size=len(bpe_tokenizer), pad_token_id=bpe_tokenizer.pad_token_id,
        bos_token_id=bpe_tokenizer.bos_token_id, eos_token_id=bpe_tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF's default init is tiny; bigger weights make padding bugs visible
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.2)
    return model


@pytest.fixture
def tokenizer(bpe_tokenizer):
    """The shared tokenizer with its padding side restored after each test."""
    side = bpe_tokenizer.padding_side
    yield bpe_tokenizer
    bpe_tokenizer.padding_side = side


# ---------------------------------------------------------------- batching


def test_plan_batches_by_batch_size_longest_first():
    # lengths by index: 0:5 1:3 2:9 3:3 4:7 5:1 -> longest first, ties by index: 2 4 0 1 3 5
    assert plan_batches([5, 3, 9, 3, 7, 1], batch_size=2, max_tokens=None) == [[2, 4], [0, 1], [3, 5]]


def test_plan_batches_by_padded_tokens():
    # 9*2=18 > 14 so [2] alone; 7*2=14 fits, 7*3=21 does not; 3*3=9 fits
    assert plan_batches([5, 3, 9, 3, 7, 1], batch_size=3, max_tokens=14) == [[2], [4, 0], [1, 3, 5]]
    assert plan_batches([20, 2], batch_size=4, max_tokens=10) == [[0], [1]]  # too long still gets a batch
    assert plan_batches([], batch_size=4, max_tokens=10) == []


def test_plan_batches_covers_every_index_once_within_limits():
    rng = random.Random(7)
    lengths = [rng.randint(0, 60) for _ in range(500)]
    plan = plan_batches(lengths, batch_size=16, max_tokens=400)
    assert sorted(i for batch in plan for i in batch) == list(range(500))
    assert plan == plan_batches(lengths, batch_size=16, max_tokens=400)
    for batch in plan:
        assert len(batch) <= 16
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 400


@pytest.mark.parametrize("args", [(0, None), (4, 0)])
def test_plan_batches_rejects_bad_limits(args):
    with pytest.raises(ValueError):
        plan_batches([1, 2], *args)


# ---------------------------------------------------------------- hook points


def _inputs(tokenizer, texts):
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


@pytest.mark.numerics
def test_captured_layers_match_hf_hidden_states(llama, tokenizer):
    """layers.L.out is HF hidden_states[L+1] for L < n-1; HF's last entry is final-normed, ours is not."""
    inputs = _inputs(tokenizer, TEXTS[:3])
    layers_list = llama.model.layers
    with torch.inference_mode():
        reference = llama(**inputs, output_hidden_states=True, use_cache=False).hidden_states
        with capture_layer_outputs(layers_list, [0, 1, 2], stop_early=False) as captured:
            llama(**inputs, use_cache=False)
        assert len(reference) == 4  # embeddings + 3 layers
        # the same forward run twice: equal up to float32 round-off of the chain (tests/tolerances.py)
        for layer in (0, 1):
            assert_float32_close(captured[layer].numpy(), reference[layer + 1].numpy(), terms=CHAIN_TERMS)
        assert_float32_close(llama.model.norm(captured[2]).numpy(), reference[3].numpy(), terms=CHAIN_TERMS)
        assert (captured[2] - reference[3]).abs().max() > 0.1


def test_early_stop_skips_later_blocks(llama, tokenizer):
    calls = {i: 0 for i in range(3)}
    head_calls = []

    def counter(i):
        return lambda *_: calls.__setitem__(i, calls[i] + 1)

    handles = [block.register_forward_hook(counter(i)) for i, block in enumerate(llama.model.layers)]
    handles.append(llama.lm_head.register_forward_hook(lambda *_: head_calls.append(1)))
    try:
        with torch.inference_mode(), capture_layer_outputs(llama.model.layers, [1, 0]) as captured:
            llama(**_inputs(tokenizer, TEXTS[:2]), use_cache=False)
            pytest.fail("the forward should have stopped after layer 1")
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {0: 1, 1: 1, 2: 0}
    assert head_calls == []
    assert sorted(captured) == [0, 1]


def test_hooks_removed_after_exit_and_on_error(llama, tokenizer):
    inputs = _inputs(tokenizer, TEXTS[:2])
    blocks = llama.model.layers
    before = [n_hooks(block) for block in blocks]
    with torch.inference_mode():
        expected = llama(**inputs, use_cache=False).logits
        with capture_layer_outputs(blocks, [2]):
            assert n_hooks(blocks[2]) == before[2] + 1
            llama(**inputs, use_cache=False)
        assert [n_hooks(block) for block in blocks] == before
        with pytest.raises(RuntimeError, match="boom"), capture_layer_outputs(blocks, [0, 2]):
            raise RuntimeError("boom")
        assert [n_hooks(block) for block in blocks] == before

        def exploding(hidden):
            raise ValueError("inside the forward")

        with pytest.raises(ValueError, match="inside"), add_hooks(blocks, {"layers.1.out": exploding}):
            llama(**inputs, use_cache=False)
        assert [n_hooks(block) for block in blocks] == before
        assert torch.equal(llama(**inputs, use_cache=False).logits, expected)


def test_add_hooks_edits_the_residual_stream(llama, tokenizer):
    inputs = _inputs(tokenizer, TEXTS[:2])
    blocks = llama.model.layers
    shift = torch.linspace(-1, 1, 32)
    with torch.inference_mode():
        with capture_layer_outputs(blocks, [1]) as plain:
            llama(**inputs, use_cache=False)
        with add_hooks(blocks, {"layers.1.out": lambda h: h + 2.0 * shift}), \
                capture_layer_outputs(blocks, [1, 2], stop_early=False) as steered:
            steered_logits = llama(**inputs, use_cache=False).logits
        torch.testing.assert_close(steered[1], plain[1] + 2.0 * shift)
        # the rest of the network ran on the edited state: replay block 2 by hand through a new forward
        with add_hooks(blocks, {"layers.1.out": lambda h: None}):  # None keeps the state
            unchanged = llama(**inputs, use_cache=False).logits
        assert not torch.allclose(steered_logits, unchanged)
        assert torch.equal(unchanged, llama(**inputs, use_cache=False).logits)


@pytest.mark.parametrize("name", ["layers.3.out", "layers.1.in", "blocks.1.out"])
def test_add_hooks_rejects_unknown_names(llama, name):
    with pytest.raises(HookPointError), add_hooks(llama.model.layers, {name: lambda h: h}):
        pass


@pytest.mark.parametrize("layers", [[3], [-1], [], [1, 1]])
def test_capture_rejects_bad_layers(llama, layers):
    with pytest.raises(HookPointError), capture_layer_outputs(llama.model.layers, layers):
        pass


class TupleBlock(nn.Module):
    """A block in the old HF style: returns (hidden, attention_weights)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return hidden * self.scale + 1.0, None


def test_tuple_returning_blocks():
    blocks = nn.ModuleList([TupleBlock(2.0), TupleBlock(3.0)])

    def run(x):
        for block in blocks:
            x = block(x)[0]
        return x

    x = torch.ones(1, 2, 4)
    with capture_layer_outputs(blocks, [0, 1], stop_early=False) as captured:
        out = run(x)
    assert torch.equal(captured[0], torch.full((1, 2, 4), 3.0))
    assert torch.equal(captured[1], torch.full((1, 2, 4), 10.0))
    assert torch.equal(out, captured[1])
    with add_hooks(blocks, {"layers.0.out": lambda h: h - 3.0}):
        assert torch.equal(run(x), torch.full((1, 2, 4), 1.0))  # (3-3)*3+1
    assert torch.equal(run(x), out)


# ---------------------------------------------------------------- extraction


def _passages(texts):
    return [
        Passage(id=f"p{i}", text=t, label=i % 2, domain="d", token_count=0, matched_pair_id=None,
                split="train", concept="c")
        for i, t in enumerate(texts)
    ]


def test_extract_covers_every_passage_once_with_contract_shapes(llama, tokenizer):
    stats = ExtractionStats()
    out = list(extract_activations(llama, tokenizer, llama.model.layers, _passages(TEXTS), [2, 0],
                                   batch_size=3, stats=stats))
    lengths = [len(tokenizer(t)["input_ids"]) for t in TEXTS]
    plan = plan_batches(lengths, batch_size=3, max_tokens=None)
    assert [b.passage_ids for b in out] == [[f"p{i}" for i in batch] for batch in plan]
    for batch, indices in zip(out, plan, strict=True):
        assert isinstance(batch, ActivationBatch)
        longest = max(lengths[i] for i in indices)
        assert batch.layers == (2, 0)
        assert batch.hidden.shape == (2, len(indices), longest, 32)
        assert batch.hidden.dtype == np.float32
        assert batch.lengths.tolist() == [lengths[i] for i in indices]
        assert batch.texts == [TEXTS[i] for i in indices]
        assert batch.hook_points == ["layers.2.out", "layers.0.out"]
    assert stats.batches == len(plan) and stats.passages == len(TEXTS)
    assert stats.tokens == sum(lengths)
    assert stats.padded_tokens == sum(max(lengths[i] for i in b) * len(b) for b in plan)


@pytest.mark.numerics
@pytest.mark.parametrize("side", ["left", "right"])
def test_extracted_hidden_matches_unbatched_forward(llama, tokenizer, side):
    """Each passage's real tokens get the hidden state it has when run alone (no padding at all)."""
    tokenizer.padding_side = side
    out = list(extract_activations(llama, tokenizer, llama.model.layers, TEXTS, [0, 2], batch_size=4))
    for batch in out:
        for b, pid in enumerate(batch.passage_ids):
            alone = tokenizer(TEXTS[int(pid)], return_tensors="pt")
            real = batch.attention_mask[b]
            with torch.inference_mode():
                ref = llama(**alone, output_hidden_states=True, use_cache=False).hidden_states
                last_normed = llama.model.norm(torch.from_numpy(batch.hidden[1, b][real]))
            # padded in a batch of 4 vs alone: other kernel blockings, so equal up to the chain's round-off
            assert_float32_close(batch.hidden[0, b][real], ref[1][0].numpy(), terms=CHAIN_TERMS)
            assert_float32_close(last_normed.numpy(), ref[3][0].numpy(), terms=CHAIN_TERMS)
            np.testing.assert_array_equal(batch.input_ids[b][real], alone["input_ids"][0].numpy())


def _mean_pooled(batches):
    pooled = {}
    for batch in batches:
        for b, pid in enumerate(batch.passage_ids):
            pooled[pid] = batch.hidden[:, b][:, batch.attention_mask[b]].mean(axis=1)
    return pooled


def test_left_and_right_padding_agree(llama, tokenizer):
    results = {}
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batches = list(extract_activations(llama, tokenizer, llama.model.layers, TEXTS, [0, 1, 2],
                                           batch_size=8))
        assert len(batches) == 1
        mask = batches[0].attention_mask
        assert (~mask[:, 0]).any() if side == "left" else (~mask[:, -1]).any()
        results[side] = _mean_pooled(batches)
    for pid in results["left"]:
        np.testing.assert_allclose(results["left"][pid], results["right"][pid], atol=1e-4)


def test_offsets_and_special_tokens(llama, tokenizer):
    tokenizer.padding_side = "right"
    texts = ["The cat sat", "hi"]
    (batch,) = extract_activations(llama, tokenizer, llama.model.layers, texts, [0], ids=["a", "b"])
    assert batch.passage_ids == ["a", "b"]
    bos = tokenizer.bos_token_id
    for b, text in enumerate(batch.texts):
        real = batch.attention_mask[b]
        assert batch.input_ids[b, 0] == bos and batch.special_mask[b, 0]
        assert batch.special_mask[b].tolist() == [True] + [False] * (batch.input_ids.shape[1] - 1)
        assert batch.offsets[b, 0].tolist() == [0, 0]
        assert (batch.offsets[b][~real] == 0).all()
        spans = [text[s:e] for s, e in batch.offsets[b][real & ~batch.special_mask[b]]]
        assert "".join(spans) == text.replace(" ", "")  # byte-level offsets trimmed of the leading space
        token_ids = batch.input_ids[b][real & ~batch.special_mask[b]]
        words = [tokenizer.decode([int(i)]).strip() for i in token_ids]
        assert spans == words
    assert batch.offsets[1, 1].tolist() == [0, 2]  # "hi"


def test_truncation_at_max_length(llama, tokenizer):
    batches = list(extract_activations(llama, tokenizer, llama.model.layers, TEXTS, [1], max_length=4))
    assert max(b.lengths.max() for b in batches) == 4
    assert all(b.hidden.shape[2] <= 4 for b in batches)


def test_forward_only_times_the_same_batches(llama, tokenizer):
    batches = prepare_batches(tokenizer, TEXTS, batch_size=3, max_tokens=40)
    plain = forward_only(llama, batches)
    hooked = ExtractionStats()
    list(extract_batches(llama, llama.model.layers, batches, [1], stats=hooked))
    counts = (plain.batches, plain.tokens, plain.padded_tokens)
    assert counts == (hooked.batches, hooked.tokens, hooked.padded_tokens)
    assert all(max(b.attention_mask.sum(1)) * len(b.indices) <= 40 for b in batches if len(b.indices) > 1)


def test_extraction_errors(llama, tokenizer):
    with pytest.raises(ExtractionError, match="2 texts but 1"):
        extract_activations(llama, tokenizer, llama.model.layers, ["a", "b"], [0], ids=["x"])
    foreign = nn.ModuleList([nn.Identity()])
    with pytest.raises(ExtractionError, match="never ran"):
        list(extract_activations(llama, tokenizer, foreign, ["a"], [0]))


def test_float16_output(llama, tokenizer):
    (batch,) = extract_activations(llama, tokenizer, llama.model.layers, ["hi"], [0], dtype_out=np.float16)
    assert batch.hidden.dtype == np.float16


# ---------------------------------------------------------------- encoder


@pytest.fixture(scope="module")
def bert_and_tokenizer():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 3, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                 cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(hf), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=hf.pad_token_id)
    return BertModel(config, add_pooling_layer=False).eval(), hf


def test_encoder_through_the_same_code(bert_and_tokenizer):
    bert, tok = bert_and_tokenizer
    blocks = bert.encoder.layer
    results = {}
    for side in ("right", "left"):
        tok.padding_side = side
        batches = list(extract_activations(bert, tok, blocks, TEXTS, [0, 1], batch_size=8))
        (batch,) = batches
        enc = tok(batch.texts, return_tensors="pt", padding=True)
        if side == "right":  # HF's padded forward; BERT has no final norm, so every entry is a block output
            with torch.inference_mode():
                ref = bert(**enc, output_hidden_states=True).hidden_states
            for i, layer in enumerate((0, 1)):
                np.testing.assert_allclose(batch.hidden[i], ref[layer + 1].numpy(), atol=1e-5)
        cls, sep = tok.cls_token_id, tok.sep_token_id
        for b in range(len(batch.passage_ids)):
            real_ids = batch.input_ids[b][batch.attention_mask[b]]
            assert real_ids[0] == cls and real_ids[-1] == sep
            flags = batch.special_mask[b][batch.attention_mask[b]]
            assert flags.tolist() == [True] + [False] * (len(flags) - 2) + [True]
            assert not batch.special_mask[b][~batch.attention_mask[b]].any()
        results[side] = _mean_pooled(batches)
    tok.padding_side = "right"
    for pid in results["right"]:
        np.testing.assert_allclose(results["left"][pid], results["right"][pid], atol=1e-4)


class RecordingSink:
    """A capture sink that logs its finish; with `wait_for`, finish first waits (bounded) for the next chunk's
    preparation to have started, so a run where preparation does not run ahead fails instead of racing."""

    def __init__(self, index: int, log: list, started: dict, wait_for: int | None) -> None:
        self.index, self.log, self.started, self.wait_for = index, log, started, wait_for
        self.layers: list[int] = []

    def __call__(self, layer, hidden, extras) -> None:
        self.layers.append(layer)

    def finish(self) -> None:
        if self.wait_for is not None:
            self.log.append(("next prepared in time", self.started[self.wait_for].wait(timeout=60)))
        self.log.append(("finish", self.index))


@pytest.mark.parametrize("overlap", [False, True])
def test_the_next_chunk_is_prepared_while_this_one_runs(llama, tokenizer, overlap):
    """prepare_for(chunk k+1) runs on the background thread during chunk k's capture with overlap (the first
    chunk's during its own forward), strictly after it without; either way every sink comes from its own chunk's
    preparation, in order."""
    import threading

    from poolbench.extractor.capture import capture_chunks

    batches = prepare_batches(tokenizer, TEXTS, batch_size=2)
    order = [tuple(b.passage_ids) for b in batches]
    started = {i: threading.Event() for i in range(len(order))}
    log: list = []

    def prepare(chunk):
        index = order.index(tuple(chunk.passage_ids))
        log.append(("prepare", index, threading.current_thread() is threading.main_thread()))
        started[index].set()
        ahead = index + 1 if overlap and index + 1 < len(order) else None
        return lambda: RecordingSink(index, log, started, ahead)

    stats = ExtractionStats()
    out = list(capture_chunks(llama, llama.model.layers, batches, [0, 2], prepare_for=prepare, overlap=overlap,
                              stats=stats, max_batch_tokens=4096))
    assert [sink.index for _, sink in out] == list(range(len(order))) and len(order) == 4
    assert all(sink.layers == [0, 2] for _, sink in out)
    events = [e[:2] for e in log if e[0] != "next prepared in time"]
    if overlap:
        assert all(e[1] for e in log if e[0] == "next prepared in time")
        for k in range(len(order) - 1):  # chunk k+1 prepared before chunk k's sink finished
            assert events.index(("prepare", k + 1)) < events.index(("finish", k))
        # the first one too, beside its own forward (its layers kept until its sink is made: KeptLayers)
        assert [e[2] for e in log if e[0] == "prepare"] == [False, False, False, False]
        assert stats.prepared_ahead == len(order)
    else:
        assert events == [step for k in range(len(order)) for step in (("prepare", k), ("finish", k))]
        assert stats.prepared_ahead == 0
    assert stats.prepare_seconds > 0
