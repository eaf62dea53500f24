"""GGUF checkpoints through load_model: written here by the gguf package from a tiny Llama, converted once, cached."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_models import CHAT_TEMPLATE, tied_gqa_llama, tiny_tokenizer, write_tiny_gguf
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from poolbench.extractor import gguf_checkpoint
from poolbench.extractor.gguf_checkpoint import INFO_FILE, GGUFCheckpointError
from poolbench.extractor.loading import load_model, load_tokenizer, model_ready

TEXT = "The kids ran home after the long game."


@pytest.fixture(scope="module")
def source() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    tokenizer = tiny_tokenizer()
    return tied_gqa_llama(tokenizer), tokenizer


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, source) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", *source)


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache per test (unlike conftest's shared `cache`): the tests count what a conversion leaves."""
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.numerics
def test_gguf_loads_with_the_logits_of_the_model_it_was_written_from(gguf_file, source, fresh_cache):
    model, tokenizer = source
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert not model_ready(str(gguf_file))
    loaded = load_model(str(gguf_file), dtype="float32", device="cpu")
    assert model_ready(str(gguf_file))
    assert (loaded.model_id, loaded.kind, loaded.n_layers, loaded.hidden_size) == (str(gguf_file), "causal", 2, 64)
    assert loaded.path.parent == fresh_cache / "models" and loaded.path.name.startswith("gguf-")
    torch.testing.assert_close(_logits(loaded.model, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    # The same vocabulary and merges: the GGUF's tokenizer splits text into the same ids. Its offsets keep each
    # token's leading space (GPT-2's ByteLevel, untrimmed), so the spans tile the text.
    enc = loaded.tokenizer(TEXT, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    assert "".join(TEXT[s:e] for s, e in enc["offset_mapping"]) == TEXT
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert (loaded.tokenizer.bos_token, loaded.tokenizer.eos_token, loaded.tokenizer.pad_token) == \
        ("<s>", "</s>", "<pad>")


def test_converted_folder_is_a_plain_hf_folder(gguf_file, source, fresh_cache):
    model, _ = source
    path = load_model(str(gguf_file), dtype="float32", device="cpu").path
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["tie_word_embeddings"]) == (["LlamaForCausalLM"], True)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    weights = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: stored once, as the input embeddings
    # Copied, not re-initialised: q rows back in HF order, every tensor equal to the source's.
    source_sd = model.state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, source_sd[name], rtol=0, atol=0)
    assert sorted(weights) == sorted(k for k in source_sd if k != "lm_head.weight")
    info = json.loads((path / INFO_FILE).read_text())
    assert info["sha256"] == gguf_checkpoint.file_sha256(gguf_file) and info["architecture"] == "llama"
    assert (path / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_second_load_reuses_the_conversion(gguf_file, fresh_cache, monkeypatch):
    first = load_model(str(gguf_file), dtype="float32", device="cpu").path
    stamp = (first / INFO_FILE).stat().st_mtime_ns, (first / "model.safetensors").stat().st_mtime_ns

    def no_reconversion(*args: object) -> None:
        raise AssertionError("converted an already converted GGUF again")

    monkeypatch.setattr(gguf_checkpoint, "_convert_into", no_reconversion)
    again = load_model(str(gguf_file), dtype="float32", device="cpu")
    assert again.path == first
    assert ((first / INFO_FILE).stat().st_mtime_ns, (first / "model.safetensors").stat().st_mtime_ns) == stamp
    # Keyed by content: a copy under another name, in a folder of its own, reuses the same folder.
    copy_dir = fresh_cache.parent / "elsewhere"
    copy_dir.mkdir()
    shutil.copy(gguf_file, copy_dir / "renamed.gguf")
    assert load_model(str(copy_dir), dtype="float32", device="cpu").path == first
    assert sorted(p.name for p in (fresh_cache / "models").iterdir()) == sorted(["gguf-hashes", first.name])


def test_tokenizer_alone_comes_from_the_conversion(gguf_file, source, fresh_cache):
    tokenizer = load_tokenizer(str(gguf_file))
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == source[1](TEXT, add_special_tokens=False)[
        "input_ids"]


def test_q8_0_weights_are_the_dequantised_values(tmp_path, source, fresh_cache):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    model, tokenizer = source
    path = write_tiny_gguf(tmp_path / "tiny.Q8_0.gguf", model, tokenizer, quant="Q8_0")
    loaded = load_model(str(path), dtype="float32", device="cpu")
    up = model.model.layers[1].mlp.up_proj.weight.detach().numpy()
    expected = dequantize(quantize(up, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(loaded.model.model.layers[1].mlp.up_proj.weight.numpy(), expected)
    assert 0 < np.abs(expected - up).max() < 0.01  # quantised (not the float weights), within Q8_0's step


def _one_line(err: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_unsupported_architecture_is_one_line_naming_the_file(tmp_path, source, fresh_cache):
    path = write_tiny_gguf(tmp_path / "odd.gguf", *source, architecture="poolbench-toy")
    with pytest.raises(GGUFCheckpointError) as err:
        load_model(str(path))
    _one_line(err, f"GGUF '{path}'", "architecture 'poolbench-toy' is not supported by transformers")
    models = fresh_cache / "models"
    assert not models.exists() or [p.name for p in models.iterdir()] == ["gguf-hashes"]


def test_undequantisable_tensor_type_is_one_line_naming_the_file(tmp_path, source, fresh_cache):
    path = write_tiny_gguf(tmp_path / "q81.gguf", *source, raw_tensor=("blk.0.ffn_up.weight", "Q8_1"))
    with pytest.raises(GGUFCheckpointError) as err:
        load_model(str(path))
    _one_line(err, f"GGUF '{path}'", "'blk.0.ffn_up.weight' is quantised as Q8_1")


def test_not_a_gguf_and_ambiguous_folders_are_one_line(tmp_path, gguf_file, fresh_cache):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(GGUFCheckpointError) as err:
        load_model(str(junk))
    _one_line(err, f"GGUF '{junk}' could not be read")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_file, two / name)
    with pytest.raises(GGUFCheckpointError) as err:
        load_model(str(two))
    _one_line(err, f"'{two}' holds 2 GGUF files (a.gguf, b.gguf)")
    with pytest.raises(gguf_checkpoint.ModelLoadError, match=r"^model '.*missing\.gguf' not found"):
        load_model(str(tmp_path / "missing.gguf"))


def test_interrupted_conversion_leaves_no_folder(gguf_file, fresh_cache, monkeypatch):
    def explode(gguf: Path, out: Path, architecture: str) -> None:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_checkpoint, "_convert_into", explode)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(gguf_file))
    assert sorted(p.name for p in (fresh_cache / "models").iterdir()) == ["gguf-hashes"]


def test_file_hash_is_remembered_until_the_file_changes(tmp_path, gguf_file, fresh_cache):
    copy = tmp_path / "m.gguf"
    shutil.copy(gguf_file, copy)
    first = gguf_checkpoint.file_sha256(copy)
    before = copy.stat()
    with copy.open("r+b") as fh:  # same size, new bytes
        fh.seek(-4, os.SEEK_END)
        fh.write(b"\x01\x02\x03\x04")
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # a later mtime, past clock granularity
    assert gguf_checkpoint.file_sha256(copy) != first
