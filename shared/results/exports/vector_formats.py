"""An exported steering vector written as llama.cpp's GGUF control vector, a safetensors layer map, or a torch file.

GGUF (llama.cpp control vector): `general.architecture = controlvector`, `controlvector.model_hint`,
`controlvector.layer_count`, one F32 tensor `direction.<n>` per layer. What n means, read in llama.cpp's source
(ggml-org/llama.cpp): `common_control_vector_load_one` (common/common.cpp) refuses n = 0 ("invalid (zero)
direction tensor layer index") and stores direction.n at row n - 1 of its buffer ("layer 1 at [0]");
`llama_adapter_cvec::apply` (src/llama-adapter.cpp at fdfa89f12e75c37bc0883891151b5f93c2239126) copies row n - 1
into `tensors[n]` ("there's never a tensor for layer 0"); and each model graph adds `tensors[il]` to block il's
output, `cur = build_cvec(cur, il); cb(cur, "l_out", il)` after the FFN residual add (src/models/llama.cpp at
4add2b49edfe4309b393df37be512c85e7fb0a7e, il counting blocks from 0). So direction.n is added to the output of
0-based block n, which is PoolBench's hook point `layers.{n}.out`: the index is the same number, and block 0's
output (PoolBench layer 0) is the one layer the format cannot address. repeng's ControlModel reads the same file
the same way (directions[n] added to `model.layers[n]`'s output). llama.cpp scales each file by its
`--control-vector-scaled FNAME S` strength, which is PoolBench's alpha in the unit the metadata's `unit` names.
PoolBench's own metadata goes under `poolbench.*` keys (llama.cpp and repeng ignore keys they do not know).

safetensors: `{str(layer): tensor}` (steering-vectors' `SteeringVector.layer_activations`, EasySteer's per-layer
map), the metadata as strings in the header. pt: `torch.save` of {"layer_activations": {layer: tensor},
"metadata": {...}}, plain tensors, ints and strings only, so `torch.load(..., weights_only=True)` reads it.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np

from poolbench.atomic_write import atomic_file
from poolbench.results.exports.vector_export import RESIDUAL_SITES, ExportedVector, ExportError

Format = Literal["gguf", "safetensors", "pt"]
FORMATS: tuple[str, ...] = ("gguf", "safetensors", "pt")
SUFFIX = {"gguf": ".gguf", "safetensors": ".safetensors", "pt": ".pt"}


def check_expressible(vec: ExportedVector, fmt: str) -> None:
    """One line when `fmt` cannot hold the vector: an unknown format, a site other than a block's output (GGUF
    control vectors and layer maps are added there), or layer 0 in GGUF (direction.0 is refused by llama.cpp)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format: '{fmt}' is not one of {', '.join(FORMATS)}")
    if fmt in ("gguf", "safetensors") and vec.site not in RESIDUAL_SITES:
        raise ExportError(f"--format {fmt}: the vector is at site '{vec.site}' ({vec.hook_point}); {fmt} control "
                          "vectors are added to a block's residual output only (export it with --format pt)")
    if fmt == "gguf" and vec.layer < 1:
        raise ExportError(f"--format gguf: layer {vec.layer} cannot be addressed; llama.cpp control vectors start at "
                          "direction.1 (block 1's output); block 0's output has no tensor there")


def gguf_bytes(vec: ExportedVector) -> bytes:
    """The control-vector GGUF file's bytes (written through gguf's own writer, in a scratch folder)."""
    import gguf

    arch = "controlvector"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vector.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_string(f"{arch}.model_hint", str(vec.metadata.get("model_id") or "unknown"))
        writer.add_uint32(f"{arch}.layer_count", 1)
        for key, value in vec.metadata.items():
            if isinstance(value, int):  # bool included
                writer.add_int64(f"poolbench.{key}", int(value))
            elif isinstance(value, float):
                writer.add_float64(f"poolbench.{key}", value)
            else:
                writer.add_string(f"poolbench.{key}", str(value))
        writer.add_tensor(f"direction.{vec.layer}", np.ascontiguousarray(vec.vector, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes()


def safetensors_bytes(vec: ExportedVector) -> bytes:
    from safetensors.numpy import save

    metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in vec.metadata.items()}
    return save({str(vec.layer): np.ascontiguousarray(vec.vector, dtype=np.float32)}, metadata=metadata)


def pt_bytes(vec: ExportedVector) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"layer_activations": {vec.layer: torch.from_numpy(np.array(vec.vector, dtype=np.float32))},
                "metadata": dict(vec.metadata)}, buffer)
    return buffer.getvalue()


def write_vector(vec: ExportedVector, fmt: str, out: Path) -> Path:
    """Write `vec` in `fmt` to `out` (a file, or a folder to hold `<concept>-<strategy>-L<layer>.<suffix>`),
    atomically; the path written."""
    check_expressible(vec, fmt)
    target = out / f"{vec.concept}-{vec.strategy}-L{vec.layer}{SUFFIX[fmt]}" if out.is_dir() else out
    data = {"gguf": gguf_bytes, "safetensors": safetensors_bytes, "pt": pt_bytes}[fmt](vec)
    with atomic_file(target) as fh:
        fh.write(data)
    return target
