"""StrategySpec validation and identity, the registry, and the plugin loaders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from poolbench.errors import StrategyError
from poolbench.pooler import registry
from poolbench.pooler.registry import (
    get_strategy,
    list_strategies,
    load_entry_point_strategies,
    load_strategy_module,
    register_strategy,
    resolve_strategies,
    unregister_strategy,
)
from poolbench.pooler.spec import StrategySpec
from poolbench.pooler.windows import window_spec

BUILTIN_IDS = ["P1_last", "P2_first", "A1_mean", "A2_max", "A3_min", "A4_norm_weighted",
               "W1_first_k", "W2_last_k", "W3_middle_k", "W4_hierarchical",
               "S1_attention", "S2_gradient", "S3_iti_probe",
               "L1_pos_filtered", "L2_dependency_rel", "L3_entity", "L4_clause", "L5_keyword", "L6_sentence"]


def ones(ctx):
    return np.ones(ctx.attention_mask.shape)


def spec(**overrides) -> StrategySpec:
    fields = {"id": "X1_test", "code": "X1", "family": "other", "kind": "weights", "weights_fn": ones,
              "description": "A strategy made up for a test."}
    return StrategySpec(**{**fields, **overrides})


@pytest.fixture
def clean_registry():
    """Whatever a test registers is removed afterwards, so tests don't leak strategies into each other."""
    before = set(registry._BY_ID)
    yield
    for strategy_id in set(registry._BY_ID) - before:
        unregister_strategy(strategy_id)


def test_builtins_are_registered_in_family_order() -> None:
    assert [s.id for s in resolve_strategies(None)] == BUILTIN_IDS
    assert [s.id for s in list_strategies()] == BUILTIN_IDS


def test_get_by_id_or_code() -> None:
    assert get_strategy("A1") is get_strategy("A1_mean")
    assert get_strategy("W4").params == (("n_chunks", 4),)
    assert get_strategy("W2_last_k").params == (("k", 8),)
    assert get_strategy("A2").kind == "reduction" and get_strategy("A2").reduction == "max"


def test_resolve_keeps_order_and_drops_repeats() -> None:
    assert [s.id for s in resolve_strategies(["W2", "P1_last", "W2_last_k"])] == ["W2_last_k", "P1_last"]


def test_unknown_strategy_lists_the_known_ones() -> None:
    with pytest.raises(StrategyError, match=r"unknown strategy 'Z9' \(known: P1_last, P2_first, "):
        resolve_strategies(["A1", "Z9"])
    with pytest.raises(StrategyError, match="a list of names"):
        resolve_strategies("A1")


def test_duplicate_id_and_duplicate_code_are_rejected(clean_registry) -> None:
    with pytest.raises(StrategyError, match="'A1_mean' is already registered"):
        register_strategy(get_strategy("A1"))
    with pytest.raises(StrategyError, match="code 'A1' already names 'A1_mean'"):
        register_strategy(spec(id="A1_other", code="A1"))


def test_reference_variants_are_listed_only_on_request(clean_registry) -> None:
    ref = register_strategy(spec(id="A1_mean_ref", code="A1", reference_variant=True))
    assert ref not in list_strategies() and ref in list_strategies(include_reference=True)
    assert ref not in resolve_strategies(None)
    assert get_strategy("A1").id == "A1_mean" and get_strategy("A1_mean_ref") is ref


@pytest.mark.parametrize(("overrides", "message"), [
    ({"id": "mean"}, "id must look like"),
    ({"id": "X1_Mean"}, "id must look like"),
    ({"code": "X2"}, "does not match the id's prefix 'X1'"),
    ({"family": "magic"}, "unknown family 'magic'"),
    ({"description": "short"}, "10-500 characters"),
    ({"description": "x" * 501}, "10-500 characters"),
    ({"kind": "sum"}, "kind must be"),
    ({"reduction": "max"}, "kind 'weights' needs"),
    ({"weights_fn": None}, "kind 'weights' needs"),
    ({"kind": "reduction", "reduction": "max"}, "kind 'reduction' needs"),
    ({"kind": "reduction", "weights_fn": None, "reduction": "mean"}, "kind 'reduction' needs"),
    ({"params": (("k", [1]),)}, "params must be"),
    ({"params": (("k", 1), ("k", 2))}, "repeated name"),
    ({"needs": frozenset({"telepathy"})}, "needs must be"),
    ({"supervision": "labels"}, "requires 'labels' in needs"),
    ({"version": 0}, "version must be"),
])
def test_malformed_specs_raise_one_line_naming_the_id(overrides: dict, message: str) -> None:
    with pytest.raises(StrategyError, match=message) as info:
        spec(**overrides)
    assert str(info.value).startswith(f"strategy spec {overrides.get('id', 'X1_test')!r}:")
    assert "\n" not in str(info.value)


def test_fingerprint_is_canonical_json_identity() -> None:
    assert get_strategy("A1").fingerprint() == {"id": "A1_mean", "params": {"sink": "auto"}, "version": 1}
    assert window_spec("W2", k=16).fingerprint() == {"id": "W2_last_k16", "params": {"k": 16}, "version": 1}
    assert spec(params=(("b", 1), ("a", "x"))).fingerprint()["params"] == {"a": "x", "b": 1}
    assert spec(version=2).fingerprint() != spec().fingerprint()


def test_window_variants_have_their_own_ids_and_compare_by_value() -> None:
    assert window_spec("W2") == get_strategy("W2_last_k")
    assert window_spec("W2", k=16) == window_spec("W2", k=16)
    assert window_spec("W2", k=16) != window_spec("W2", k=8)
    variants = [window_spec("W1", k=4), window_spec("W3", k=2), window_spec("W4", n_chunks=8)]
    assert [v.id for v in variants] == ["W1_first_k4", "W3_middle_k2", "W4_hierarchical_c8"]
    with pytest.raises(StrategyError, match="k must be a positive int"):
        window_spec("W1", k=0)
    with pytest.raises(StrategyError, match="unknown param"):
        window_spec("W4", k=3)
    with pytest.raises(StrategyError, match="unknown window strategy code 'W9'"):
        window_spec("W9")


def test_load_strategy_module_registers_user_specs(tmp_path: Path, clean_registry) -> None:
    plugin = tmp_path / "my_strategies.py"
    plugin.write_text(
        "import numpy as np\n"
        "from poolbench.pooler.registry import register_strategy\n"
        "from poolbench.pooler.spec import StrategySpec\n"
        "register_strategy(StrategySpec(id='U1_even', code='U1', family='other', kind='weights',\n"
        "    weights_fn=lambda ctx: (ctx.rank % 2 == 0), description='Mean of even-ranked tokens.'))\n"
    )
    added = load_strategy_module(plugin)
    assert [s.id for s in added] == ["U1_even"]
    assert get_strategy("U1") is added[0]


def test_load_strategy_module_errors_name_the_file(tmp_path: Path, clean_registry) -> None:
    with pytest.raises(StrategyError, match=r"missing\.py: strategy module must be an existing \.py file"):
        load_strategy_module(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def oops(:\n")
    with pytest.raises(StrategyError, match=r"broken.py: cannot load strategy module: SyntaxError") as info:
        load_strategy_module(broken)
    assert "\n" not in str(info.value)
    half = tmp_path / "half.py"
    half.write_text(
        "from poolbench.pooler.registry import register_strategy, get_strategy\n"
        "from poolbench.pooler.spec import StrategySpec\n"
        "register_strategy(StrategySpec(id='U2_half', code='U2', family='other', kind='reduction',\n"
        "    reduction='max', description='Registered before the failure.'))\n"
        "register_strategy(get_strategy('A1'))\n"
    )
    with pytest.raises(StrategyError, match=r"half\.py: cannot load .*'A1_mean' is already registered"):
        load_strategy_module(half)
    with pytest.raises(StrategyError, match="unknown strategy 'U2'"):
        get_strategy("U2")  # a failed load leaves nothing half-registered


class FakeEntryPoint:
    def __init__(self, name: str, module: str, load) -> None:
        self.name, self.module, self.value, self.load = name, module, f"{module}:register", load


def test_entry_point_plugins_are_loaded_and_failures_named(monkeypatch, clean_registry) -> None:
    def good():
        register_strategy(spec(id="E1_plugin", code="E1"))

    def bad():
        raise ImportError("no module named 'nowhere'")

    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [FakeEntryPoint("good", "fake_good_plugin", good)]
                        if group == "poolbench.strategies" else [])
    assert [s.id for s in load_entry_point_strategies()] == ["E1_plugin"]
    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEntryPoint("bad", "fake_bad", bad)])
    with pytest.raises(StrategyError, match="strategy plugin 'bad' \\(fake_bad:register\\): ImportError"):
        load_entry_point_strategies()
