"""The reference-code variants against values worked out by hand from the reference's rules
(2023mc21517-arch/poolbench, poolbench/pooling_strategies.py at commit 2ec219d): the length rules on constructed
states (T = 6, 7, 11, where its W4 makes more than five chunks), A4_norm's mean of unit vectors, and the token
rules through real tokenizers (the default model's byte-level BPE shipped in poolbench/data, no BOS; the tiny
model's, with <s>; a WordPiece and a SentencePiece-style one built with `tokenizers`) on a passage with a quote,
digits, a comma, a newline and a word split into many tokens."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_alignment_parses import sentencepiece_like, tiny, wordpiece
from tolerances import assert_weighted_mean_close
from transformers import PreTrainedTokenizerFast

from poolbench.corpus.token_count import default_tokenizer
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.padded_batches import PaddedBatch, prepare_batches
from poolbench.pooler.device_pool import DevicePooler
from poolbench.pooler.naive import pool_naive
from poolbench.pooler.parses import ParseIndex, batch_parse_extras
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.reference_tokens import token_root_extra
from poolbench.pooler.registry import get_strategy
from poolbench.pooler.spec import TokenContext


def position_batch(lengths: list[int]) -> ActivationBatch:
    """Token t of every passage holds [t, 1] at layer 0 and [2t, 1] at layer 1; padding (on the right) holds 99."""
    n, length = len(lengths), max(lengths)
    hidden = np.full((2, n, length, 2), 99.0, dtype=np.float32)
    mask = np.zeros((n, length), dtype=bool)
    for b, k in enumerate(lengths):
        t = np.arange(k, dtype=np.float32)
        hidden[0, b, :k] = np.stack([t, np.ones(k)], axis=1)
        hidden[1, b, :k] = np.stack([2 * t, np.ones(k)], axis=1)
        mask[b, :k] = True
    return ActivationBatch([f"p{b}" for b in range(n)], ["x"] * n, (0, 1), hidden, mask,
                           np.zeros((n, length), np.int64), np.zeros((n, length, 2), np.int32),
                           np.zeros((n, length), bool))


@pytest.mark.numerics
def test_w4_reference_chunks_by_max_1_t_div_4_for_every_length() -> None:
    # T = 6, 7: chunks of one token (6 and 7 of them), the plain mean; T = 11: chunks of 2, 2, 2, 2, 2, 1 with means
    # 0.5, 2.5, 4.5, 6.5, 8.5, 10; T = 9: 2, 2, 2, 2, 1; T = 3: three one-token chunks; T = 8: four chunks of 2
    lengths = [6, 7, 11, 9, 3, 8, 1]
    expected = [2.5, 3.0, (0.5 + 2.5 + 4.5 + 6.5 + 8.5 + 10) / 6, (0.5 + 2.5 + 4.5 + 6.5 + 8) / 5, 1.0, 3.5, 0.0]
    batch = position_batch(lengths)
    spec = get_strategy("W4_ref_remainder")
    for pooled in (pool_tokens(batch, [spec]), pool_naive(batch, [spec])):
        assert_weighted_mean_close(pooled.vectors[0, 0, :, 0], expected, batch.hidden[0], 11)
        assert_weighted_mean_close(pooled.vectors[1, 0, :, 0], 2 * np.array(expected), batch.hidden[1], 11)
    # the cap at five chunks this variant used to have is 0.39 off at T = 11: (0.5+2.5+4.5+6.5+9.5)/5 = 4.7
    assert abs(expected[2] - 4.7) > 0.7


@pytest.mark.numerics
def test_a4_norm_is_the_mean_of_unit_vectors() -> None:
    batch = position_batch([3, 2])
    batch.hidden[:, 0, :3] = [[3, 4], [0, 2], [1, 0]]  # norms 5, 2, 1
    batch.hidden[:, 1, :2] = [[0, 9], [-2, 0]]
    expected = np.array([[(0.6 + 0 + 1) / 3, (0.8 + 1 + 0) / 3], [-1 / 2, 1 / 2]])
    spec = get_strategy("A4_norm")
    assert spec.reference_variant and spec.divide_by == "token_count"
    for pooled in (pool_tokens(batch, [spec]), pool_naive(batch, [spec]), device_pooled(batch, spec)):
        for layer in (0, 1):
            assert_weighted_mean_close(pooled.vectors[layer, 0], expected, batch.hidden[layer], 3)
        assert not pooled.fallback.any()
    # what a weighted mean with these weights would give instead (normalised by their own sum): not the reference
    card_like = (np.array([3, 4]) / 5 + np.array([0, 2]) / 2 + np.array([1, 0])) / (1 / 5 + 1 / 2 + 1)
    assert np.abs(card_like - expected[0]).max() > 0.1


def device_pooled(batch: ActivationBatch, spec):
    """The capture's on-device path (here on the CPU device): token norms and the token-count divisor in torch."""
    chunk = PaddedBatch(list(range(len(batch.passage_ids))), batch.passage_ids, batch.texts, batch.input_ids,
                        batch.attention_mask, batch.offsets, batch.special_mask)
    pooler = DevicePooler([spec], chunk, batch.layers, dict(batch.extras), torch.device("cpu"))
    for i, layer in enumerate(batch.layers):
        pooler(layer, torch.from_numpy(batch.hidden[i]), {})
    pooler.finish()
    assert pooler.pooled is not None
    return pooler.pooled


TEXT = 'She said "indemnify" 12,500 times.\nThe dogs ran.'
# spaCy's words as its English pipeline parses TEXT (the newline, a whitespace token, is not in PoolBench's parses)
WORDS = [(0, 3, "nsubj", -1), (4, 8, "ROOT", -1), (9, 10, "punct", -1), (10, 19, "dobj", -1), (19, 20, "punct", -1),
         (21, 27, "nummod", 0), (28, 33, "npadvmod", -1), (33, 34, "punct", -1), (35, 38, "det", -1),
         (39, 43, "nsubj", -1), (44, 47, "ROOT", -1), (47, 48, "punct", -1)]


def smollm2_bpe() -> PreTrainedTokenizerFast:
    """The default (embedded) model's tokenizer: byte-level BPE, no BOS, offsets keeping the leading space."""
    return PreTrainedTokenizerFast(tokenizer_object=copy.deepcopy(default_tokenizer()), pad_token="<|endoftext|>")


TOKENIZERS = {"default_bpe": smollm2_bpe, "embedded_bpe": tiny, "wordpiece": wordpiece,
              "sentencepiece": sentencepiece_like}
# Each tokenizer's tokens of TEXT, by position (index 0 is <s> or [CLS] where there is one), and their rules' picks:
# default_bpe:  She Ġsaid Ġ" ind em n ify " Ġ 1 2 , 5 0 0 Ġtimes . Ċ The Ġdogs Ġran .   (Ġsaid spans (3, 8))
# embedded_bpe: <s> She Ġsaid Ġ" ind e m n ify " Ġ12 , 50 0 Ġtimes . Ċ The Ġdo gs Ġran .
# wordpiece:    [CLS] s ##he s ##a ##i ##d [UNK] [UNK] [UNK] 1 ##2 , 5 ##0 ##0 [UNK] . the [UNK] ra ##n . [SEP]
# sentencepiece: <s> ▁ <unk> he ▁ s a i d ▁ <unk> in d e <unk> n i f y <unk> ▁ 1 2 , 5 0 0 ▁ t i <unk> e s .
#                <unk> he ▁ d o <unk> s ▁r a n .
ROOTS = {  # L4: the first token, then word-initial strings (Ġ / ▁; WordPiece: every token but ##-pieces)
    "default_bpe": [0, 1, 2, 8, 15, 19, 20],  # the lone "Ġ" before the digits counts, "The" after "Ċ" does not
    "embedded_bpe": [0, 2, 3, 10, 14, 18, 20],  # "She", "ind…" after the quote, "The" after the newline: not Ġ
    "wordpiece": [0, 1, 3, 7, 8, 9, 10, 12, 13, 16, 17, 18, 19, 20, 22, 23],
    "sentencepiece": [0, 1, 4, 9, 20, 27, 36, 41],
}
SVO = {  # L5: She, said, indemnify, dogs, ran -> the token starting at each word, else the nearest before it
    "default_bpe": [0, 1, 3, 19, 20],  # "said" starts at 4, inside "Ġsaid" (3, 8): the nearest start before it
    "embedded_bpe": [1, 2, 4, 18, 20],  # "Ġ"" starts at 9, "ind" at 10: indemnify is "ind" alone (of 5 tokens)
    "wordpiece": [1, 3, 8, 19, 20],
    "sentencepiece": [1, 5, 11, 37, 41],  # "She" starts on "▁" (0, 1), the first of two tokens at 0; "ran" on "▁r"
}
# L3: "12,500", the token at its "1"
ENTITY = {"default_bpe": [9], "embedded_bpe": [10], "wordpiece": [10], "sentencepiece": [21]}


def token_batch(family: str) -> tuple[ActivationBatch, list[str]]:
    tokenizer = TOKENIZERS[family]()
    (padded,) = prepare_batches(tokenizer, [TEXT, "Dogs ran."], ids=["t0", "t1"], batch_size=2)
    rank = np.cumsum(padded.attention_mask, axis=1) - 1
    hidden = np.where(padded.attention_mask, rank, 99).astype(np.float32)[None, :, :, None]
    batch = ActivationBatch(padded.passage_ids, padded.texts, (0,), hidden, padded.attention_mask, padded.input_ids,
                            padded.offsets, padded.special_mask)
    records = {"t0": [{"start": s, "end": e, "dep": dep, "ent": ent} for s, e, dep, ent in WORDS],
               "t1": [{"start": 0, "end": 4, "dep": "nsubj"}, {"start": 5, "end": 8, "dep": "ROOT"},
                      {"start": 8, "end": 9, "dep": "punct"}]}
    batch.extras.update(batch_parse_extras(ParseIndex.from_records(records), batch.passage_ids, batch.texts,
                                           batch.offsets, batch.attention_mask))
    batch.extras["token_root"] = token_root_extra(tokenizer, batch.input_ids, batch.attention_mask)
    real = padded.input_ids[0, padded.attention_mask[0]]
    return batch, tokenizer.convert_ids_to_tokens(real.tolist())


@pytest.mark.parametrize("family", list(TOKENIZERS))
def test_token_rules_select_what_the_reference_selects(family: str) -> None:
    batch, pieces = token_batch(family)
    ctx = TokenContext.from_batch(batch)
    first = int(np.argmax(batch.attention_mask[0]))
    for strategy_id, expected in (("L4_subword_root", ROOTS), ("L5_svo", SVO), ("L3_named_entity", ENTITY)):
        weights = get_strategy(strategy_id).weights_fn(ctx)[0]
        chosen = (np.flatnonzero(weights) - first).tolist()
        assert chosen == expected[family], f"{strategy_id} on {family}: {[pieces[i] for i in chosen]}"
        assert (weights[weights > 0] == 1).all()
        pooled = pool_tokens(batch, [get_strategy(strategy_id)])
        assert_weighted_mean_close(pooled.vectors[0, 0, 0, 0], np.mean(expected[family]), batch.hidden, 50,
                                   err_msg=strategy_id)
    # the second passage, "Dogs ran.", has no entity: L3 falls back to the mean of all its tokens, as the reference
    assert pool_tokens(batch, [get_strategy("L3_named_entity")]).fallback[:, 1].all()


def test_two_words_on_one_token_count_it_twice() -> None:
    batch, _ = token_batch("wordpiece")  # "indemnify" is one [UNK] (10, 19) for this WordPiece
    starts, rows = batch.extras["parse_start"], batch.extras["parse_batch"]
    entity = np.concatenate([(rows == 0) & np.isin(starts, [10, 21]), [True]])  # indemnify, 12,500 and a word
    batch.extras["parse_start"] = np.concatenate([starts, [16]])  # "ify" (16, 19) inside the same [UNK]
    batch.extras["parse_batch"] = np.concatenate([rows, [0]])
    batch.extras["parse_ent"] = np.where(entity, 0, -1)
    weights = get_strategy("L3_named_entity").weights_fn(TokenContext.from_batch(batch))[0]
    first = int(np.argmax(batch.attention_mask[0]))
    assert weights[first + 8] == 2 and weights[first + 10] == 1 and weights.sum() == 3  # mean (8+8+10)/3, not 9
