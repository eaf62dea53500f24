"""The tiny model: deterministic, atomic, learns, and loads like any Hugging Face model directory."""

from __future__ import annotations

import json
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from poolbench.corpus.english import generated_texts
from poolbench.extractor import tiny_model as em
from poolbench.extractor.loading import load_model

TOY = dict(vocab_size=384, hidden_size=64, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=128,
            seq_len=64, batch_size=8, steps=60, warmup_steps=5, max_heldout_sequences=8, threads=1)
TEXTS = generated_texts(400, seed=1)
Builds = tuple[em.BuildReport, em.BuildReport]


@pytest.fixture(scope="module")
def tiny_builds(tmp_path_factory: pytest.TempPathFactory) -> Builds:
    root = tmp_path_factory.mktemp("tiny")
    return (em.build_tiny_model(root / "a", TEXTS, seed=0, **TOY),
            em.build_tiny_model(root / "b", TEXTS, seed=0, **TOY))


def test_two_builds_give_identical_bytes(tiny_builds: Builds) -> None:
    a, b = (r.out_dir for r in tiny_builds)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert tiny_builds[0].losses == tiny_builds[1].losses


def test_build_restores_global_torch_state(tmp_path: Path) -> None:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    em.build_tiny_model(tmp_path / "m", TEXTS[:200], **{**TOY, "steps": 2})
    assert torch.equal(torch.rand(3), expected)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)


def test_loss_starts_at_log_vocab_and_decreases(tiny_builds: Builds) -> None:
    report = tiny_builds[0]
    assert len(report.losses) == 60
    # A fresh model predicts nearly uniformly over the 384 tokens: loss ≈ ln(384) = 5.95.
    assert report.losses[0] == pytest.approx(math.log(384), abs=0.2)
    assert sum(report.losses[-5:]) / 5 < report.losses[0] - 1.0
    assert report.heldout_perplexity < 384 / 4


def test_build_report_written_next_to_weights(tiny_builds: Builds) -> None:
    report = tiny_builds[0]
    info = json.loads((report.out_dir / em.BUILD_INFO_FILE).read_text())
    assert info["steps"] == 60 and info["seed"] == 0
    assert info["tokens_seen"] == 60 * 8 * 64
    assert info["config"]["hidden_size"] == 64 and info["config"]["vocab_size"] == 384
    assert info["torch_version"] == torch.__version__
    assert info["heldout_perplexity"] == pytest.approx(report.heldout_perplexity)
    assert info["n_train_texts"] + info["n_heldout_texts"] == 400 and info["n_heldout_texts"] == 20
    assert info["texts_sha256"] == em.texts_digest(TEXTS)
    assert info["tokenizer_vocab_size"] == len(AutoTokenizer.from_pretrained(report.out_dir)) == 384


def test_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    def explode(step: int, loss: float) -> None:
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        em.build_tiny_model(tmp_path / "model", TEXTS, on_step=explode, **TOY)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match=re.escape(str(tmp_path))):
        em.build_tiny_model(tmp_path, TEXTS, **TOY)


def test_loads_through_auto_classes_and_load_model(tiny_builds: Builds) -> None:
    path = tiny_builds[0].out_dir
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    enc = tokenizer(["The baker sold twelve apples."], return_tensors="pt")
    assert enc["input_ids"][0, 0].item() == tokenizer.bos_token_id
    assert model(**enc).logits.shape == (1, enc["input_ids"].shape[1], len(tokenizer))

    loaded = load_model(str(path))
    assert (loaded.kind, loaded.n_layers, loaded.hidden_size) == ("causal", 2, 64)
    assert loaded.decoder_layers is loaded.model.model.layers
    assert loaded.model.config.tie_word_embeddings
    assert loaded.tokenizer.pad_token == "<pad>"


def _token_bytes(token: str) -> bytes:
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    return bytes(byte_of[ch] for ch in token)


@pytest.mark.parametrize("text", [
    "The café opened at 6:30 — right on time!",
    "Hello,   world!!  It's 1987; $12.50?",
    "naïve résumé — 🙂 straße",
    "  two leading spaces and a trailing one ",
])
def test_offsets_are_character_spans(tiny_builds: Builds, text: str) -> None:
    """Offset rules: leading spaces are trimmed, so a whitespace-only token has the empty span (end, end);
    a token holding part of a multi-byte character has that whole character's span, shared with the
    token(s) holding its other bytes, so each run of tokens with one span spells exactly that substring."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_builds[0].out_dir)
    enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "<s>" and enc["offset_mapping"][0] == (0, 0) and enc["special_tokens_mask"][0] == 1
    runs: list[tuple[tuple[int, int], bytes]] = []
    for token, span in zip(tokens[1:], enc["offset_mapping"][1:], strict=True):
        content = _token_bytes(token).lstrip(b" ")
        if not content:  # spaces only: an empty span right after them ((0, 0) at the very start of text)
            assert span[0] == span[1] and (span[0] == 0 or text[span[0] - 1] == " "), (token, span)
            continue
        if runs and runs[-1][0] == span:
            runs[-1] = (span, runs[-1][1] + content)
        else:
            runs.append((span, content))
    for (start, end), content in runs:
        assert content == text[start:end].encode("utf-8"), (start, end, content)
    assert "".join(text[s:e] for (s, e), _ in runs) == text.replace(" ", "")
    if "🙂" in text:  # a character the tokenizer never saw: its 4 bytes are 4 tokens sharing its span
        start = text.index("🙂")
        assert [(s, e) for s, e in enc["offset_mapping"] if s == start and e > s] == [(start, start + 1)] * 4


def test_ensure_builds_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(em, "DEFAULT_CONFIG", em.TinyModelConfig(**{**TOY, "steps": 3}))
    monkeypatch.setattr(em, "tiny_training_texts", lambda: TEXTS[:200])
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path))
    path = em.ensure_tiny_model()
    assert path.parent == tmp_path / "models"
    assert re.fullmatch(r"embedded-llama-v1-[0-9a-f]{12}", path.name)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt an existing tiny model")

    monkeypatch.setattr(em, "build_tiny_model", no_rebuild)
    assert em.ensure_tiny_model() == path
    monkeypatch.setattr(em, "tiny_training_texts", lambda: TEXTS[:201])
    assert em.tiny_model_dir(TEXTS[:201], em.DEFAULT_CONFIG, cache_dir=tmp_path) != path


def test_callers_asking_at_once_build_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers that both find no model (a barrier holds each one after its look) train it once: the second
    waits for the first one's lock and returns its directory. Without the lock both train."""
    monkeypatch.setattr(em, "DEFAULT_CONFIG", em.TinyModelConfig(**{**TOY, "steps": 2}))
    monkeypatch.setattr(em, "tiny_training_texts", lambda: TEXTS[:200])
    both_looked = threading.Barrier(2, timeout=60)
    real_dir, real_build = em.tiny_model_dir, em.build_tiny_model
    builds: list[Path] = []

    def looked(*args: object, **kwargs: object) -> Path:
        out = real_dir(*args, **kwargs)
        assert not (out / em.BUILD_INFO_FILE).exists()
        both_looked.wait()
        return out

    def counted(out_dir: Path, *args: object, **kwargs: object) -> em.BuildReport:
        builds.append(out_dir)
        return real_build(out_dir, *args, **kwargs)

    monkeypatch.setattr(em, "tiny_model_dir", looked)
    monkeypatch.setattr(em, "build_tiny_model", counted)
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: em.ensure_tiny_model(tmp_path), range(2)))
    assert paths[0] == paths[1] and builds == [paths[0]]
    assert (paths[0] / em.BUILD_INFO_FILE).is_file()


@pytest.mark.slow
def test_default_build_learns(tmp_path: Path) -> None:
    """The real default recipe: minutes on 2 cores; held-out perplexity far below the 4096-token vocab."""
    path = em.ensure_tiny_model(tmp_path)
    info = json.loads((path / em.BUILD_INFO_FILE).read_text())
    assert info["config"] == asdict(em.DEFAULT_CONFIG)
    assert info["heldout_perplexity"] < info["tokenizer_vocab_size"] / 20
    loaded = load_model(str(path))
    assert (loaded.n_layers, loaded.hidden_size, loaded.kind) == (4, 256, "causal")
