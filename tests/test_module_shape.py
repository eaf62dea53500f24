"""The house's shape: no module over 500 lines (the library, the services, the tests, the benches, the deploy
scripts), and no import cycle between modules.

A room that grows past 500 lines stops reading alone (a test module as much as the code it holds to account),
and two modules that import each other are one idea split badly (one of them cannot be read, loaded or tested
without the other). The import graph is grimp's (what import-linter builds), so imports inside functions and
under TYPE_CHECKING count as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp
import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


FOLDERS = ("shared", "services", "tests", "bench", "deploy")


def test_no_module_over_500_lines():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
               for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}
    assert sum(path.startswith(("shared/", "services/")) for path in lengths) > 100  # the house, not an empty folder
    assert sum(path.startswith("tests/") for path in lengths) > 100  # and its tests
    over = {path: n for path, n in lengths.items() if n > MAX_LINES}
    assert over == {}, f"modules over {MAX_LINES} lines: {over}"


def import_graph() -> grimp.ImportGraph:
    """poolbench's import graph without the imports pyproject's layers contract ignores (the root package's lazy
    API, PEP 562: `import poolbench` loads poolbench.api only on first use)."""
    graph = grimp.build_graph("poolbench", cache_dir=None)
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for ignored in {i for contract in contracts for i in contract.get("ignore_imports", [])}:
        importer, imported = (part.strip() for part in ignored.split("->"))
        graph.remove_import(importer=importer, imported=imported)
    return graph


def import_cycles(graph: grimp.ImportGraph) -> list[tuple[str, ...]]:
    """Every cycle through a direct import, each once: the import a -> b and b's shortest chain back to a."""
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycle = (importer, *back[:-1])
                start = cycle.index(min(cycle))
                cycles.add(cycle[start:] + cycle[:start])
    return sorted(cycles)


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert "poolbench.results.pages.report" in graph.modules  # the graph holds the house
    assert import_cycles(graph) == []


@pytest.mark.parametrize("extra", [("a", "b"), ("a", "b", "c")])
def test_the_cycle_check_finds_a_planted_cycle(extra):
    """Should fail: a module pair (or triple) importing round in a circle is reported, once, as that circle."""
    graph = import_graph()
    before = set(import_cycles(graph))
    modules = [f"poolbench.planted_{name}" for name in extra]
    for importer, imported in zip(modules, modules[1:] + modules[:1], strict=True):
        graph.add_import(importer=importer, imported=imported)
    assert set(import_cycles(graph)) - before == {tuple(modules)}
