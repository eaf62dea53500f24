"""GGUF checkpoints as ordinary model folders: dequantised once into safetensors, cached by the file's sha256.

transformers reads a GGUF with `gguf_file=`, but it dequantises on every load (~30 s for a 135M model on 2 cores)
and a model loaded that way refuses `save_pretrained` ("quantized with gguf"). So the first use copies the loaded
weights into a model built from the config without its quantization entry, saves it with the tokenizer and chat
template into a temp folder and renames that into the cache; every later load is a plain local load.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from poolbench.defaults import cache_dir as poolbench_cache_dir
from poolbench.errors import ModelLoadError
from poolbench.store.keys import cached_sha256

GGUF_SUFFIX = ".gguf"
INFO_FILE = "poolbench_gguf.json"  # written last: its presence means the folder is complete
log = logging.getLogger(__name__)


class GGUFCheckpointError(ModelLoadError):
    """A GGUF file that cannot be read or converted; the message names the file."""


def find_gguf(path: Path) -> Path | None:
    """The GGUF a model reference names: a *.gguf file, or the only *.gguf in a folder that is no HF folder.

    A folder with config.json is a Hugging Face model folder even when it also ships GGUF files.
    """
    if path.is_file():
        return path if path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        raise GGUFCheckpointError(f"'{path}' holds {len(found)} GGUF files ({', '.join(p.name for p in found)}): "
                                  "name one of them as the model")
    return found[0] if found else None


def _hash_index(gguf: Path, cache_root: Path) -> Path:
    resolved = str(gguf.resolve())
    return cache_root / "models" / "gguf-hashes" / f"{hashlib.sha256(resolved.encode()).hexdigest()[:24]}.json"


def file_sha256(gguf: Path, cache_root: Path | None = None) -> str:
    """sha256 of the file's bytes, remembered per path with its size and mtime (a multi-GB GGUF hashes once)."""
    return cached_sha256([gguf], _hash_index(gguf, cache_root or poolbench_cache_dir()))


def converted_dir(gguf: Path, cache_root: Path | None = None) -> Path:
    """models/gguf-<sha256 prefix>: keyed by content, so a renamed or copied file reuses its conversion."""
    root = cache_root or poolbench_cache_dir()
    return root / "models" / f"gguf-{file_sha256(gguf, root)[:16]}"


def is_converted(gguf: Path, cache_root: Path | None = None) -> bool:
    return (converted_dir(gguf, cache_root) / INFO_FILE).is_file()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_gguf(gguf: Path) -> str:
    """Fail in one line, before minutes of dequantising, on a file that is no GGUF or holds a tensor type
    that the `gguf` package cannot dequantise; returns the file's architecture."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(gguf)
        field = reader.get_field("general.architecture")
        architecture = str(field.contents()) if field is not None else "unknown"
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise GGUFCheckpointError(f"GGUF '{gguf}' could not be read: {_first_line(exc)}") from exc
    seen: set[int] = set()
    for tensor in reader.tensors:
        if int(tensor.tensor_type) in seen:
            continue
        seen.add(int(tensor.tensor_type))
        try:
            dequantize(np.asarray(tensor.data[:1]), tensor.tensor_type)
        except NotImplementedError as exc:
            raise GGUFCheckpointError(
                f"GGUF '{gguf}': tensor '{tensor.name}' is quantised as {tensor.tensor_type.name}, which the gguf "
                "package cannot dequantise") from exc
    return architecture


def _plain_copy(loaded: PreTrainedModel, auto: type) -> PreTrainedModel:
    """The loaded weights in a model whose config has no quantization entry (so it can be saved).

    Built on the meta device and filled by assignment, so the copy costs no second set of weights; the tie
    between input embeddings and LM head is restored afterwards.
    """
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        plain = auto.from_config(config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return plain


@contextmanager
def _bars_on_a_terminal_only() -> Iterator[None]:
    """transformers' de-quantisation bar, piped to a log, is carriage-return debris: shown on a terminal only."""
    was = hf_logging.is_progress_bar_enabled()
    if was and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _convert_into(gguf: Path, out: Path, architecture: str) -> None:
    with _bars_on_a_terminal_only():
        _convert(gguf, out, architecture)


def _convert(gguf: Path, out: Path, architecture: str) -> None:
    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise GGUFCheckpointError(f"GGUF '{gguf}': architecture '{architecture}' is not supported by transformers "
                                  f"{transformers.__version__} ({_first_line(exc)})") from exc
    causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    auto = AutoModelForCausalLM if causal else AutoModel
    try:
        loaded = auto.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, TypeError) as exc:
        raise GGUFCheckpointError(f"GGUF '{gguf}' could not be converted: {_first_line(exc)}") from exc
    _plain_copy(loaded, auto).save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_converted(gguf: Path, cache_root: Path | None = None) -> Path:
    """The HF folder converted from `gguf`, converting first if missing (atomically: a temp dir, then rename)."""
    out = converted_dir(gguf, cache_root)
    if (out / INFO_FILE).is_file():
        return out
    architecture = check_gguf(gguf)
    log.info("converting GGUF %s into %s (once)", gguf, out)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    try:
        _convert_into(gguf, tmp, architecture)
        info = {"source": str(gguf.resolve()), "sha256": file_sha256(gguf, cache_root or poolbench_cache_dir()),
                "architecture": architecture, "seconds": round(time.perf_counter() - start, 1),
                "transformers_version": transformers.__version__, "torch_version": torch.__version__}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / INFO_FILE).is_file():  # unless a concurrent conversion renamed its folder first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
