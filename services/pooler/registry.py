"""The strategy registry: built-in families are registered here, in one place; plugins add to it later."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path

from poolbench.errors import StrategyError
from poolbench.pooler import (
    aggregation,
    iti,
    learned,
    linguistic,
    position,
    reference,
    reference_tokens,
    saliency,
    windows,
)
from poolbench.pooler.spec import StrategySpec

ENTRY_POINT_GROUP = "poolbench.strategies"

_BY_ID: dict[str, StrategySpec] = {}
_FROM_MODULE: dict[str, tuple[str, ...]] = {}  # user module name -> the strategy ids its import registered
_BY_CODE: dict[str, StrategySpec] = {}  # non-reference spec per code, so "A1" resolves to "A1_mean"


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add a spec; ids are unique and each code names at most one non-reference strategy."""
    if not isinstance(spec, StrategySpec):
        raise StrategyError(f"register_strategy expects a StrategySpec, got {type(spec).__name__}")
    if spec.id in _BY_ID:
        raise StrategyError(f"strategy {spec.id!r} is already registered")
    if _claims_code(spec) and spec.code in _BY_CODE:
        raise StrategyError(f"strategy {spec.id!r}: code {spec.code!r} already names "
                            f"{_BY_CODE[spec.code].id!r}")
    _BY_ID[spec.id] = spec
    if _claims_code(spec):
        _BY_CODE[spec.code] = spec
    return spec


def _claims_code(spec: StrategySpec) -> bool:
    """Card strategies own their code; reference variants and named variants are reached by id only."""
    return not spec.reference_variant and spec.variant_of is None


def unregister_strategy(strategy_id: str) -> None:
    """Remove a spec (tests and plugin reloads); unknown ids are an error so typos don't pass silently."""
    spec = get_strategy(strategy_id)
    del _BY_ID[spec.id]
    if _BY_CODE.get(spec.code) is spec:
        del _BY_CODE[spec.code]


def get_strategy(name: str) -> StrategySpec:
    """A spec by id ("A1_mean") or by code ("A1")."""
    spec = _BY_ID.get(name) or _BY_CODE.get(name)
    if spec is None:
        raise StrategyError(f"unknown strategy {name!r} (known: {', '.join(_BY_ID)})")
    return spec


def list_strategies(include_reference: bool = False, include_opt_in: bool = False) -> list[StrategySpec]:
    """Registered specs in registration order: the card strategies, plus every variant on request; opt-in
    strategies (the learned aggregators, which train) only when asked for."""
    return [spec for spec in _BY_ID.values() if (include_reference or _claims_code(spec))
            and (include_opt_in or not spec.opt_in)]


def resolve_strategies(names: Sequence[str] | None) -> list[StrategySpec]:
    """Specs for ids/codes in the given order (duplicates dropped); None means all non-reference ones."""
    if names is None:
        return list_strategies()
    if isinstance(names, str):
        raise StrategyError(f"resolve_strategies expects a list of names, got the string {names!r}")
    resolved: dict[str, StrategySpec] = {}
    for name in names:
        spec = get_strategy(name)
        resolved.setdefault(spec.id, spec)
    return list(resolved.values())


def load_strategy_module(path: str | Path) -> list[StrategySpec]:
    """Import a user .py file that calls register_strategy; returns the specs it added."""
    path = Path(path)
    if path.suffix != ".py" or not path.is_file():
        raise StrategyError(f"{path}: strategy module must be an existing .py file")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"poolbench_user_strategies.{path.stem}_{digest}"
    registered = _FROM_MODULE.get(module_name)
    if registered is not None and all(strategy_id in _BY_ID for strategy_id in registered):
        return []  # loaded already and still registered (a run over several models loads plugins per model)
    before = set(_BY_ID)
    try:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError("not importable")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        for strategy_id in set(_BY_ID) - before:
            unregister_strategy(strategy_id)
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise StrategyError(f"{path}: cannot load strategy module: {type(exc).__name__}: {message}") from exc
    added = [spec for strategy_id, spec in _BY_ID.items() if strategy_id not in before]
    _FROM_MODULE[module_name] = tuple(spec.id for spec in added)
    return added


def load_entry_point_strategies() -> list[StrategySpec]:
    """Load installed plugins of the "poolbench.strategies" entry-point group (each registers on import)."""
    before = set(_BY_ID)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.module in sys.modules:
            continue
        try:
            entry_point.load()
        except Exception as exc:
            message = str(exc).splitlines()[0] if str(exc) else ""
            raise StrategyError(f"strategy plugin {entry_point.name!r} ({entry_point.value}): "
                                f"{type(exc).__name__}: {message}") from exc
    return [spec for strategy_id, spec in _BY_ID.items() if strategy_id not in before]


for _family in (position, aggregation, windows, saliency, iti, linguistic, reference, reference_tokens, learned):
    for _spec in _family.SPECS:
        register_strategy(_spec)
