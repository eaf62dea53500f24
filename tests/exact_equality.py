"""Where the tests claim exact equality of computed values (issue 41): a scan of the test sources for the calls that
compare bit for bit, so that each one is held against tests/exact_equality_sites.py and its reason."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

# Calls that assert or test exact equality of arrays, tensors or Arrow data.
EQUAL_CALLS = {"assert_array_equal", "array_equal", "assert_equal", "equal", "equals"}
# Calls that compare with a tolerance, exact when both tolerances are a literal 0.
CLOSE_CALLS = {"assert_close", "assert_allclose", "allclose", "isclose"}
# `==` with one of these on a side compares whole files or records, floats included.
RECORD_CALLS = {"read_bytes", "dumps", "to_dict"}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _exact_site(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        name = _name(node.func)
        if name in EQUAL_CALLS:
            return True
        if name in CLOSE_CALLS:
            zero = {kw.arg for kw in node.keywords if kw.arg in ("rtol", "atol") and _is_zero(kw.value)}
            return zero == {"rtol", "atol"}
    if isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq) for op in node.ops):
        return any(_whole_record(side) for side in [node.left, *node.comparators])
    return False


def _whole_record(node: ast.expr) -> bool:
    """A file's bytes, a record as JSON, or a list of records as dicts: `==` on these compares every float in them."""
    if isinstance(node, ast.ListComp):
        node = node.elt
    return isinstance(node, ast.Call) and _name(node.func) in RECORD_CALLS


class _Sites(ast.NodeVisitor):
    """Counts exact-equality sites per enclosing top-level function (or `<module>`); a call under `not` claims a
    difference, not an equality, and is left out."""

    def __init__(self) -> None:
        self.where = ["<module>"]
        self.counts: Counter[str] = Counter()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.where.append(node.name if len(self.where) == 1 else self.where[-1])
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not) and _exact_site(node.operand):
            for child in ast.iter_child_nodes(node.operand):
                self.visit(child)
            return
        self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        if _exact_site(node):
            self.counts[self.where[-1]] += 1
        super().generic_visit(node)


def scan_source(source: str) -> Counter[str]:
    """Exact-equality sites in one module's source, counted per top-level function."""
    visitor = _Sites()
    visitor.visit(ast.parse(source))
    return visitor.counts


def scan_tests(folder: Path) -> dict[str, int]:
    """`file::function` -> number of exact-equality sites, over every .py file in the tests folder."""
    sites = {}
    for path in sorted(folder.glob("*.py")):
        for where, count in scan_source(path.read_text()).items():
            sites[f"{path.name}::{where}"] = count
    return sites
