"""Word-to-token alignment for byte-level BPE, SentencePiece-style and WordPiece tokenizers and the tiny model's
(its recipe's tokenizer, built once per session in the session's temp cache), spaCy parses through the real
pipeline, the parse cache, and the README's plugin example read from README.md."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from poolbench.defaults import cache_dir
from poolbench.extractor.activations import ActivationBatch
from poolbench.extractor.padded_batches import prepare_batches
from poolbench.extractor.tiny_model import build_tiny_model, tiny_training_texts
from poolbench.pooler.parses import ParseIndex, batch_parse_extras, cached_parse_table, load_nlp, parse_table
from poolbench.pooler.pool import pool_tokens
from poolbench.pooler.reference_tokens import token_root_extra
from poolbench.pooler.registry import get_strategy, load_strategy_module, unregister_strategy
from poolbench.pooler.spec import TokenContext
from poolbench.store.local import LocalStore

TEXTS = ["Zoë's café isn't open, but Bob's is!  Unbelievably cheap.",
         "Paris hosted 12,500 runners in 2024. It rained."]
TRAIN = [*TEXTS, "the cafe and the runners were open and cheap", "unbelievable rain in paris"] * 4


def byte_level_bpe(trim: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=trim),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>")


def sentencepiece_like() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "<unk>"],
                                      unk_token="<unk>")
    tok.train_from_iterator(TRAIN, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>",
                                   unk_token="<unk>")


def wordpiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TRAIN, trainers.WordPieceTrainer(
        vocab_size=70, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


@functools.cache
def tiny_recipe_dir() -> Path:
    """The tiny model's recipe (same texts, same train split, same tokenizer) with a 1-step, 32-wide model: its
    tokenizer is the real tiny model's, built in seconds into the session's temp cache, never the user's."""
    out = cache_dir() / "tiny-tokenizer-recipe"
    if not out.exists():
        build_tiny_model(out, tiny_training_texts(), steps=1, hidden_size=32, n_layers=1, n_heads=2,
                         n_kv_heads=1, intermediate_size=64, warmup_steps=0, max_heldout_sequences=2)
    return out


def tiny() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_recipe_dir())


TOKENIZERS = {"bpe_trimmed": lambda: byte_level_bpe(True), "bpe_untrimmed": lambda: byte_level_bpe(False),
              "sentencepiece": sentencepiece_like, "wordpiece": wordpiece, "tiny": tiny}


def regex_parses(texts: list[str]) -> ParseIndex:
    records = {}
    for i, text in enumerate(texts):
        records[f"t{i}"] = [{"start": m.start(), "end": m.end(), "lower": m.group().lower(),
                             "is_alpha": m.group().isalpha()} for m in re.finditer(r"\w+|[^\w\s]", text)]
    return ParseIndex.from_records(records)


def batch_for(tokenizer, side: str) -> ActivationBatch:
    tokenizer.padding_side = side
    (padded,) = prepare_batches(tokenizer, TEXTS, ids=["t0", "t1"], batch_size=2)
    n, length = padded.input_ids.shape
    positions = np.arange(length, dtype=np.float32)[None, None, :, None]
    hidden = np.broadcast_to(positions, (1, n, length, 1)).copy()
    return ActivationBatch(padded.passage_ids, padded.texts, (0,), hidden, padded.attention_mask,
                           padded.input_ids, padded.offsets, padded.special_mask)


@pytest.mark.parametrize("family", list(TOKENIZERS))
@pytest.mark.parametrize("side", ["right", "left"])
def test_every_word_maps_to_the_tokens_that_spell_it(family: str, side: str) -> None:
    tokenizer = TOKENIZERS[family]()
    batch = batch_for(tokenizer, side)
    index = regex_parses(TEXTS)
    extras = batch_parse_extras(index, batch.passage_ids, batch.texts, batch.offsets, batch.attention_mask)
    starts, ends = extras["parse_start"], extras["parse_end"]
    pair_b, pair_t, pair_w = extras["parse_pair_b"], extras["parse_pair_t"], extras["parse_pair_w"]
    for w in range(len(starts)):
        b = extras["parse_batch"][w]
        tokens = pair_t[pair_w == w]
        assert len(tokens), f"{family}: word {batch.texts[b][starts[w]:ends[w]]!r} has no token"
        spans = batch.offsets[b, tokens]
        assert spans[:, 0].min() <= starts[w] and spans[:, 1].max() >= ends[w]  # the tokens cover the word
        assert not batch.special_mask[b, tokens].any()
    for b in range(2):  # every non-special token with visible text belongs to some word
        for t in np.flatnonzero(batch.attention_mask[b] & ~batch.special_mask[b]):
            s, e = batch.offsets[b, t]
            if batch.texts[b][s:e].strip():
                assert ((pair_b == b) & (pair_t == t)).any(), f"{family}: token {t} {batch.texts[b][s:e]!r}"
    batch.extras.update(extras, token_root=token_root_extra(tokenizer, batch.input_ids, batch.attention_mask))
    roots = pool_tokens(batch, [get_strategy("L4_subword_root")])
    assert not roots.fallback.any()


def test_wordpiece_subword_root_is_the_stem_piece() -> None:
    tokenizer = wordpiece()
    batch = batch_for(tokenizer, "right")
    batch.extras["token_root"] = token_root_extra(tokenizer, batch.input_ids, batch.attention_mask)
    weights = get_strategy("L4_subword_root").weights_fn(TokenContext.from_batch(batch))
    pieces = tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    chosen = [pieces[t] for t in np.flatnonzero(weights[0])]
    assert chosen and not any(p.startswith("##") for p in chosen)
    assert any(p.startswith("##") for p in pieces)  # the test text does split words into pieces


@pytest.fixture(scope="module")
def nlp():
    return load_nlp()


def test_spacy_parses_and_linguistic_pooling_end_to_end(nlp) -> None:
    table = parse_table(nlp, TEXTS, ["t0", "t1"])
    index = ParseIndex.from_table(table)
    words = index.words("t1")
    lower = list(words["lower"])
    paris = lower.index("paris")
    assert words["ent"][paris] >= 0 and words["ent_label"][paris] == "GPE"
    assert words["lemma"][lower.index("rained")] == "rain"
    assert words["sent"].max() == 1  # two sentences
    batch = batch_for(byte_level_bpe(True), "right")
    batch.extras.update(batch_parse_extras(index, batch.passage_ids, batch.texts, batch.offsets,
                                           batch.attention_mask))
    pooled = pool_tokens(batch, [get_strategy(s) for s in ("L3_entity", "L6_sentence", "L1_pos_filtered")])
    # L6 by hand from spaCy's sentence spans: token position means per sentence, then their mean
    doc = nlp(TEXTS[1])
    sentence_means = []
    for sent in doc.sents:
        hit = [t for t in range(batch.offsets.shape[1]) if batch.attention_mask[1, t]
               and not batch.special_mask[1, t] and batch.offsets[1, t, 0] < sent.end_char
               and batch.offsets[1, t, 1] > sent.start_char
               and batch.texts[1][slice(*batch.offsets[1, t])].strip()]
        sentence_means.append(np.mean(hit))
    np.testing.assert_allclose(pooled.vectors[0, 1, 1, 0], np.mean(sentence_means), rtol=1e-5)
    entity_tokens = [t for t in range(batch.offsets.shape[1]) if batch.attention_mask[1, t]
                     and any(batch.offsets[1, t, 0] < e.end_char and batch.offsets[1, t, 1] > e.start_char
                             for e in doc.ents)]
    np.testing.assert_allclose(pooled.vectors[0, 0, 1, 0], np.mean(entity_tokens), rtol=1e-5)
    assert not pooled.fallback.any()


def test_parses_are_cached_by_corpus_hash_and_reused(nlp, tmp_path: Path, monkeypatch) -> None:
    store = LocalStore(tmp_path)
    first, cached = cached_parse_table(store, TEXTS, ["t0", "t1"], corpus_hash="c1", passages_digest="d",
                                       nlp=nlp)
    assert not cached
    monkeypatch.setattr(nlp, "pipe", lambda *a, **k: pytest.fail("parsed again instead of reusing the cache"))
    again, cached = cached_parse_table(store, TEXTS, ["t0", "t1"], corpus_hash="c1", passages_digest="d",
                                       nlp=nlp)
    assert cached and again.equals(first)


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_plugin_example() -> str:
    """The README's strategy-plugin example: its one python block that calls register_strategy."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    plugins = [block for block in blocks if "register_strategy(" in block]
    assert len(plugins) == 1, f"README.md has {len(plugins)} python blocks calling register_strategy, not 1"
    return plugins[0]


def test_readme_plugin_example_loads_and_pools(tmp_path: Path) -> None:
    """The example as the README prints it, saved as the file it names and loaded as --strategy-module would:
    each text pools to the mean position of its tokens that start with a capital letter."""
    path = tmp_path / "my_strategies.py"
    path.write_text(readme_plugin_example())
    (spec,) = load_strategy_module(path)
    try:
        batch = batch_for(byte_level_bpe(True), "right")
        pooled = pool_tokens(batch, [spec])
        assert not pooled.fallback.any()  # both texts have capitalised words
        for b, text in enumerate(batch.texts):
            # Hand-derived: hidden state = token position, so the pooled value is the capitalised positions' mean.
            capital = [t for t, (start, end) in enumerate(batch.offsets[b])
                       if batch.attention_mask[b, t] and text[start:end].strip()[:1].isupper()]
            assert len(capital) >= 2  # Zoë, Bob, Unbelievably / Paris, It
            assert pooled.vectors[0, 0, b, 0] == pytest.approx(np.mean(capital))
    finally:
        unregister_strategy(spec.id)
