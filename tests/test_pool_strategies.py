"""Saliency, linguistic and reference-variant strategies against hand-computed vectors on tiny batches whose
tokens, offsets and parses are written out by hand (no spaCy model involved)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from tolerances import assert_float32_close, assert_pooled_close

from poolbench.errors import StrategyError
from poolbench.extractor.activations import ActivationBatch
from poolbench.pooler.alignment import AlignmentError
from poolbench.pooler.concept_context import ConceptContext, trigger_table
from poolbench.pooler.linguistic import clause_ids
from poolbench.pooler.naive import pool_naive
from poolbench.pooler.parses import ParseIndex, batch_parse_extras
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.reference import passage_seed
from poolbench.pooler.registry import get_strategy, list_strategies
from poolbench.pooler.saliency import SIF_A, remove_first_component

# p1 "Ann ran. Bob sat."   tokens: <s> Ann r an . Bob sat .
# p2 "If it rains, we stay."   tokens: <s> If it rain s , we stay .
TEXTS = ["Ann ran. Bob sat.", "If it rains, we stay."]
OFFSETS = [
    [(0, 0), (0, 3), (4, 5), (5, 7), (7, 8), (9, 12), (13, 16), (16, 17)],
    [(0, 0), (0, 2), (3, 5), (6, 10), (10, 11), (11, 12), (13, 15), (16, 20), (20, 21)],
]
PARSES = {
    "p1": [
        {"start": 0, "end": 3, "lower": "ann", "lemma": "ann", "pos": "PROPN", "dep": "nsubj", "head": 1,
         "sent": 0, "ent": 0, "ent_label": "PERSON"},
        {"start": 4, "end": 7, "lower": "ran", "lemma": "run", "pos": "VERB", "dep": "ROOT", "head": 1,
         "sent": 0},
        {"start": 7, "end": 8, "lower": ".", "lemma": ".", "pos": "PUNCT", "dep": "punct", "head": 1,
         "sent": 0, "is_alpha": False},
        {"start": 9, "end": 12, "lower": "bob", "lemma": "bob", "pos": "PROPN", "dep": "nsubj", "head": 4,
         "sent": 1, "ent": 1, "ent_label": "PERSON"},
        {"start": 13, "end": 16, "lower": "sat", "lemma": "sit", "pos": "VERB", "dep": "ROOT", "head": 4,
         "sent": 1},
        {"start": 16, "end": 17, "lower": ".", "lemma": ".", "pos": "PUNCT", "dep": "punct", "head": 4,
         "sent": 1, "is_alpha": False},
    ],
    "p2": [
        {"start": 0, "end": 2, "lower": "if", "lemma": "if", "pos": "SCONJ", "dep": "mark", "head": 2,
         "is_stop": True},
        {"start": 3, "end": 5, "lower": "it", "lemma": "it", "pos": "PRON", "dep": "nsubj", "head": 2,
         "is_stop": True},
        {"start": 6, "end": 11, "lower": "rains", "lemma": "rain", "pos": "VERB", "dep": "advcl", "head": 5},
        {"start": 11, "end": 12, "lower": ",", "lemma": ",", "pos": "PUNCT", "dep": "punct", "head": 5,
         "is_alpha": False},
        {"start": 13, "end": 15, "lower": "we", "lemma": "we", "pos": "PRON", "dep": "nsubj", "head": 5,
         "is_stop": True},
        {"start": 16, "end": 20, "lower": "stay", "lemma": "stay", "pos": "VERB", "dep": "ROOT", "head": 5},
        {"start": 20, "end": 21, "lower": ".", "lemma": ".", "pos": "PUNCT", "dep": "punct", "head": 5,
         "is_alpha": False},
    ],
    # train-only passages for the TF-IDF fit: "stay" is everywhere, "rains" only in p2
    "tr1": [{"start": 0, "end": 4, "lower": "stay", "lemma": "stay", "pos": "VERB", "dep": "ROOT"}],
    "tr2": [{"start": 0, "end": 4, "lower": "stay", "lemma": "stay", "pos": "VERB", "dep": "ROOT"},
            {"start": 5, "end": 6, "lower": "x", "lemma": "x", "pos": "NOUN", "dep": "dobj", "head": 0}],
}


def make_batch(left: bool = False, order: tuple[int, ...] = (0, 1),
               extras: dict | None = None) -> ActivationBatch:
    """Token t of a passage has hidden state [t, 1] at layer 0 and [2t, 1] at layer 1; padding holds 99."""
    length = max(len(OFFSETS[i]) for i in order)
    n = len(order)
    hidden = np.full((2, n, length, 2), 99.0, dtype=np.float32)
    mask = np.zeros((n, length), dtype=bool)
    offsets = np.zeros((n, length, 2), dtype=np.int32)
    special = np.zeros((n, length), dtype=bool)
    for row, i in enumerate(order):
        k = len(OFFSETS[i])
        span = slice(length - k, length) if left else slice(0, k)
        t = np.arange(k, dtype=np.float32)
        hidden[0, row, span] = np.stack([t, np.ones(k)], axis=1)
        hidden[1, row, span] = np.stack([2 * t, np.ones(k)], axis=1)
        mask[row, span] = True
        offsets[row, span] = OFFSETS[i]
        special[row, span.start] = True
    return ActivationBatch(
        passage_ids=[f"p{i + 1}" for i in order], texts=[TEXTS[i] for i in order], layers=(0, 1),
        hidden=hidden,
        attention_mask=mask, input_ids=np.zeros((n, length), dtype=np.int64), offsets=offsets,
        special_mask=special, extras=dict(extras or {}),
    )


def parsed_batch(left: bool = False, order: tuple[int, ...] = (0, 1), top_k: int = 1) -> ActivationBatch:
    index = ParseIndex.from_records(PARSES)
    context = ConceptContext.fit("conditionality", index, ["p2", "tr1", "tr2"], top_k=top_k)
    batch = make_batch(left, order)
    batch.extras.update(batch_parse_extras(index, batch.passage_ids, batch.texts, batch.offsets,
                                           batch.attention_mask, context.word_flags))
    return batch


# expected token-index means at layer 0 (layer 1 doubles the first component), per passage p1, p2
EXPECTED_T = {
    "L1_pos_filtered": [(2 + 3 + 6) / 3, (3 + 4 + 7) / 3],  # ran(r, an) sat | rains(rain, s) stay
    "L2_dependency_rel": [None, (1 + 3 + 4) / 3],  # p1 has no mark/advcl/if: falls back; p2: If, rain, s
    "L3_entity": [(1 + 5) / 2, None],  # Ann, Bob | no entity: falls back
    "L4_clause": [(2.5 + 6) / 2, (2.5 + 6.5) / 2],  # one clause per sentence | "If it rains" + "we stay ."
    "L5_keyword": [None, (3 + 4) / 2],  # p1 words are not in the fitted vocabulary | top-1 word "rains"
    "L6_sentence": [(2.5 + 6) / 2, 36 / 8],  # sentence means (tokens 1-4, 5-7) | one sentence: tokens 1-8
    # the reference's rule: one token per nsubj/ROOT word, the one starting at the word ("ran" -> "r" only)
    "L5_svo": [(1 + 2 + 5 + 6) / 4, (2 + 6 + 7) / 3],
    "L3_named_entity": [(1 + 5) / 2, None],
}
A1_T = [28 / 8, 36 / 9]


@pytest.mark.numerics
@pytest.mark.parametrize("strategy_id", list(EXPECTED_T))
@pytest.mark.parametrize("left", [False, True])
def test_linguistic_strategies_match_hand_computed_vectors(strategy_id: str, left: bool) -> None:
    batch = parsed_batch(left)
    pooled = pool_tokens(batch, [get_strategy(strategy_id)])
    for b, expected in enumerate(EXPECTED_T[strategy_id]):
        t = A1_T[b] if expected is None else expected
        assert_pooled_close(pooled.vectors[0, 0, b], [t, 1], batch)
        assert_pooled_close(pooled.vectors[1, 0, b], [2 * t, 1], batch)
        assert pooled.fallback[0, b] == (expected is None)


@pytest.mark.numerics
def test_linguistic_strategies_agree_with_pool_naive_and_batch_order() -> None:
    specs = [get_strategy(s) for s in EXPECTED_T]
    batch = parsed_batch(left=True)
    fast, naive = pool_tokens(batch, specs), pool_naive(batch, specs)
    assert_pooled_close(fast.vectors, naive.vectors, batch)
    np.testing.assert_array_equal(fast.fallback, naive.fallback)
    swapped = pool_tokens(parsed_batch(order=(1, 0)), specs)
    assert_pooled_close(swapped.vectors[:, :, ::-1], fast.vectors, batch)


def test_clause_ids_follow_the_nearest_clause_head() -> None:
    # "If it rains , we stay ." -> the advcl "rains" heads If/it/rains; ROOT "stay" the rest
    dep = np.array(["mark", "nsubj", "advcl", "punct", "nsubj", "ROOT", "punct"])
    pos = np.array(["SCONJ", "PRON", "VERB", "PUNCT", "PRON", "VERB", "PUNCT"])
    head = np.array([2, 2, 5, 5, 5, 5, 5])
    assert clause_ids(dep, pos, head).tolist() == [2, 2, 2, 5, 5, 5, 5]
    # "She sang and he danced": verb-verb conj opens a clause; noun-noun conj ("cats and dogs") does not
    dep = np.array(["nsubj", "ROOT", "cc", "nsubj", "conj", "dobj", "cc", "conj"])
    pos = np.array(["PRON", "VERB", "CCONJ", "PRON", "VERB", "NOUN", "CCONJ", "NOUN"])
    head = np.array([1, 1, 1, 4, 1, 4, 5, 5])
    assert clause_ids(dep, pos, head).tolist() == [1, 1, 1, 4, 4, 4, 4, 4]


def test_tfidf_keywords_are_fitted_on_train_passages_only() -> None:
    index = ParseIndex.from_records(PARSES)
    context = ConceptContext.fit("conditionality", index, ["p2", "tr1", "tr2"], top_k=1)
    # smooth idf: rains ln(4/2)+1, stay ln(4/4)+1 -> "rains" wins with the same tf
    assert context.keywords(index.words("p2")) == {"rains"}
    assert context.keywords(index.words("p1")) == set()  # ann/ran/bob/sat never seen in train
    two = ConceptContext.fit("conditionality", index, ["p2", "tr1", "tr2"], top_k=2)
    assert two.keywords(index.words("p2")) == {"rains", "stay"}
    assert two.keywords_of([index.words("p2"), index.words("p1")]) == [{"rains", "stay"}, set()]


def test_trigger_table_is_data_with_a_default() -> None:
    table = trigger_table()
    assert {"mark", "advcl"} <= table["conditionality"]["deps"] and "if" in table["conditionality"]["lemmas"]
    assert "neg" in table["negation_density"]["deps"] and {"cc", "conj"} <= table["contrast"]["deps"]
    assert ConceptContext.fit("unlisted_concept", None, []).deps == table["_default"]["deps"]


@pytest.mark.numerics
def test_reference_window_variants_by_hand() -> None:
    batch = make_batch()
    expected = {  # p1 has 8 tokens (0..7), p2 has 9 (0..8)
        "W1_ref_last4": [(4 + 5 + 6 + 7) / 4, (5 + 6 + 7 + 8) / 4],
        "W2_ref_last8": [28 / 8, 36 / 8],
        "W3_ref_last16": [28 / 8, 36 / 9],
        # 8 = 4 chunks of 2; 9 = 4 chunks of 2 + a fifth chunk {8}: (0.5 + 2.5 + 4.5 + 6.5 + 8) / 5
        # (T = 6, 7, 11, where the reference makes more than five chunks: tests/test_reference_variants.py)
        "W4_ref_remainder": [3.5, 22 / 5],
        "P3_first_content": [1, 1],
    }
    for strategy_id, values in expected.items():
        spec = get_strategy(strategy_id)
        assert spec.reference_variant
        pooled = pool_tokens(batch, [spec])
        assert_pooled_close(pooled.vectors[0, 0, :, 0], values, batch, err_msg=strategy_id)


def test_w4_reference_with_fewer_tokens_than_chunks_is_the_mean() -> None:
    batch = make_batch()
    batch.attention_mask[:, 3:] = False  # 3 real tokens each
    pooled = pool_tokens(batch, [get_strategy("W4_ref_remainder")])
    assert_pooled_close(pooled.vectors[0, 0, :, 0], [1, 1], batch)


def test_p3_skips_special_and_punctuation_tokens() -> None:
    batch = make_batch(order=(0,))
    batch.texts[0] = '"nn ran. Bob sat.'
    batch.offsets[0, 1] = (0, 1)  # token 1 is the quote mark: skipped like the special token 0
    pooled = pool_tokens(batch, [get_strategy("P3_first_content")])
    np.testing.assert_allclose(pooled.vectors[0, 0, 0], [2, 1])


@pytest.mark.numerics
def test_a3_random_is_a_seeded_half_fixed_per_passage_id() -> None:
    spec = get_strategy("A3_random")
    right, left = pool_tokens(make_batch(), [spec]), pool_tokens(make_batch(left=True, order=(1, 0)), [spec])
    assert_pooled_close(left.vectors[:, 0, ::-1], right.vectors[:, 0], make_batch())
    rng = np.random.default_rng(passage_seed("p1"))
    chosen = rng.choice(8, size=4, replace=False)
    assert_pooled_close(right.vectors[0, 0, 0], [chosen.mean(), 1], make_batch())
    assert passage_seed("p1") == int.from_bytes(hashlib.sha256(b"p1").digest()[:8], "little")


@pytest.mark.numerics
def test_sif_weights_and_first_component_removal() -> None:
    batch = make_batch(order=(0,))
    batch.input_ids[0] = [1, 5, 6, 5, 7, 7, 7, 7]
    context = ConceptContext.fit("x", None, [], train_token_ids=[[5, 5, 5, 6]])  # p(5)=.75, p(6)=.25
    batch.extras["unigram_probability"] = context.unigram_probability(batch.input_ids, SIF_A)
    w = {5: SIF_A / (SIF_A + 0.75), 6: SIF_A / (SIF_A + 0.25), 7: 0.5, 1: 0.5}  # unseen ids: p = a
    weights = np.array([w[1], w[5], w[6], w[5], w[7], w[7], w[7], w[7]])  # the special token is weighed too
    pooled = pool_tokens(batch, [get_strategy("S2_sif")])
    assert_pooled_close(pooled.vectors[0, 0, 0, 0], (weights * np.arange(8)).sum() / weights.sum(), batch)
    X = np.array([[1.0, 0.0], [3.0, 0.0], [2.0, 1.0]], dtype=np.float32)
    # centred on (2, 1/3) the rows are (-1, -1/3), (1, -1/3), (0, 2/3): x variance 2, y variance 2/3, no
    # covariance, so the first principal axis is x and removing it leaves the y components (the uncentred
    # first singular vector, of [[14, 2], [2, 1]], is not the x axis: it would leave x in every row)
    # a projection of 2-d rows onto a fitted unit vector: a few roundings of the largest entry, 3
    assert_float32_close(remove_first_component(X, np.ones(3, dtype=bool)), [[0, 0], [0, 0], [0, 1]],
                         terms=2 + 2, scale=3.0)


@pytest.mark.numerics
def test_saliency_strategies_pool_with_their_extras_per_layer() -> None:
    inflow = np.zeros((2, 2, 9), dtype=np.float32)
    inflow[0, :, 2] = 1.0  # layer 0: all attention on token 2
    inflow[1, :, 1] = inflow[1, :, 3] = 0.5  # layer 1: tokens 1 and 3
    grad = np.zeros((2, 2, 9), dtype=np.float32)
    grad[:, :, 4] = 3.0
    grad[:, :, 6] = 1.0
    batch = make_batch(extras={"attention_inflow": inflow, "attention_inflow_last": inflow,
                               "gradient_norm": grad, "gradient_x_input": grad})
    specs = [get_strategy(s) for s in ("S1_attention", "S1_attention_last_query", "S2_gradient",
                                       "S2_gradient_x_input")]
    pooled = pool_tokens(batch, specs)
    np.testing.assert_allclose(pooled.vectors[0, 0, :, 0], [2, 2])
    np.testing.assert_allclose(pooled.vectors[1, 0, :, 0], [4, 4])  # layer 1 hidden is 2t: (2 + 6) / 2
    np.testing.assert_allclose(pooled.vectors[0, 2, :, 0], [(3 * 4 + 6) / 4] * 2)
    assert_pooled_close(pool_naive(batch, specs).vectors, pooled.vectors, batch)
    assert not pooled.fallback.any()


def test_missing_extras_and_misaligned_passages_are_one_line_errors() -> None:
    with pytest.raises(StrategyError, match=r"^strategy 'S1_attention': .*needs 'attention'"):
        pool_tokens(make_batch(), [get_strategy("S1_attention")])
    with pytest.raises(StrategyError, match=r"^strategy 'L1_pos_filtered': .*needs parses"):
        pool_tokens(make_batch(), [get_strategy("L1_pos_filtered")])
    batch = make_batch()
    batch.offsets[0, 3] = (5, 40)
    with pytest.raises(AlignmentError, match=r"^passage 'p1': token 3 has offsets \(5, 40\)"):
        batch_parse_extras(ParseIndex.from_records(PARSES), batch.passage_ids, batch.texts, batch.offsets,
                           batch.attention_mask)
    batch = make_batch()
    batch.texts[0] = "Ann"
    batch.offsets[0] = 0
    with pytest.raises(AlignmentError, match=r"^passage 'p1': its parse has word spans outside"):
        batch_parse_extras(ParseIndex.from_records(PARSES), batch.passage_ids, batch.texts, batch.offsets,
                           batch.attention_mask)


def test_every_registered_strategy_has_a_family_and_card_ids_are_unique_codes() -> None:
    card = list_strategies()
    assert len(card) == 19 and len({s.code for s in card}) == 19
    variants = [s for s in list_strategies(include_reference=True) if s not in card]
    assert all(s.reference_variant or s.variant_of for s in variants)
    assert get_strategy("S1").id == "S1_attention" and get_strategy("S3").supervision == "labels"


def test_tiny_llama_has_no_sink_so_auto_pools_exactly_as_keep(tiny_llama_dir) -> None:
    """The test model's first token (its BOS) is no outlier (ratio 0.9-1.1 measured): auto changes nothing."""
    from poolbench.corpus.source import open_corpus
    from poolbench.extractor.loading import load_model
    from poolbench.pooler.concept_pooling import pool_concept
    from poolbench.pooler.pooled_table import PooledTableView

    loaded = load_model(str(tiny_llama_dir), device="cpu")
    passages = open_corpus("embedded", "tiny", ["hedging"]).passages("hedging", "train")[:12]
    ids = ("A1_mean", "A2_max", "A3_min", "A4_norm_weighted", "S1_attention")
    auto = PooledTableView(pool_concept(loaded, passages, [0, 1], [get_strategy(s) for s in ids]))
    keep = PooledTableView(pool_concept(loaded, passages, [0, 1], [get_strategy(s).with_sink_mode("keep")
                                                                  for s in ids]))
    for cell in auto.cells:
        np.testing.assert_array_equal(auto.matrix(*cell).X, keep.matrix(*cell).X)
    assert len(auto.cells) == 10
