"""The embedded corpus's sentence material (templates and slot vocabulary), read from JSON files in poolbench/data.

Text lives in data, not code, so a reviewer can read and change it without touching the generator. JSON has no
tuples: a list nested in a list (a template pair, a person's name and pronouns, a fact) is read back as a tuple,
which the generator relies on (slot values are hashable, a pair unpacks).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from types import SimpleNamespace
from typing import Any

from poolbench.errors import CorpusError


def _tuples(value: Any, inner: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_tuples(v, inner=True) for v in value]
        return tuple(items) if inner else items
    return value


@cache
def load_material(name: str) -> SimpleNamespace:
    """The named JSON file of poolbench/data as a namespace of its top-level keys (keys starting `_` are notes)."""
    try:
        data = json.loads(resources.files("poolbench").joinpath("data", name).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpusError(f"poolbench/data/{name}: cannot read the corpus material ({exc})") from None
    return SimpleNamespace(**{k: _tuples(v) for k, v in data.items() if not k.startswith("_")})


