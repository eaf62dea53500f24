"""PoolBench: which pooling strategy captures a concept in an LM's hidden states, and where.

`poolbench.evaluate`, `poolbench.pool` and `poolbench.load_results` load poolbench.api on first use, so
`import poolbench` stays light (no torch, no Ray) for tools that only read results."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
API = ("evaluate", "pool", "load_results", "Results")
__all__ = ["Results", "__version__", "evaluate", "load_results", "pool"]

if TYPE_CHECKING:
    from poolbench.api import Results, evaluate, load_results, pool


def __getattr__(name: str) -> Any:
    """PEP 562: the API's names resolve on first access, importing poolbench.api then."""
    if name in API:
        import importlib

        return getattr(importlib.import_module("poolbench.api"), name)
    raise AttributeError(f"module 'poolbench' has no attribute {name!r}")
