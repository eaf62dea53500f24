"""The `chunked` CPU profile's two changes of computation, installed by the conftest in that pass only: another
CPU's GEMM may block its inner dimension differently for another row count, and a run with another batch budget
cuts batches into other chunks. No kernel contract promises a row the same bits whatever the rows beside it, so a
test that compares two batch shapes bit for bit must fail here, and one bounded by the arithmetic must pass."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Under the profile: torch runs one thread, and a forward whose caller names no token budget gets this one
# (a few rows of the test models' passages per forward, where the free-memory default takes the whole batch).
BUDGET_ENV = "POOLBENCH_TEST_MAX_BATCH_TOKENS"
_ORIGINAL_LINEAR = F.linear


def split_point(rows: int, inner: int) -> int:
    """Where the inner dimension (inner >= 2) is cut for a GEMM of `rows` rows: it moves with the row count (rows
    and rows + inner - 1 share one), as a kernel's blocking may, so two batch shapes sum in two orders."""
    return 1 + rows % (inner - 1)


def row_blocked_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear summed over the inner dimension in two blocks cut at split_point(rows): the same product, one more
    rounding per output, in an order that depends on how many rows the call holds."""
    inner = input.shape[-1]
    rows = input.numel() // inner if inner else 0
    if inner < 2 or rows == 0 or weight.dim() != 2:
        return _ORIGINAL_LINEAR(input, weight, bias)
    cut = split_point(rows, inner)
    return _ORIGINAL_LINEAR(input[..., :cut], weight[:, :cut]) + _ORIGINAL_LINEAR(input[..., cut:], weight[:, cut:],
                                                                                  bias)


def install_reblocking() -> None:
    """Route every nn.Linear (it calls F.linear at call time) through row_blocked_linear, set one torch thread,
    and give forwards without a named budget BUDGET_ENV's, for the rest of this process."""
    from poolbench.extractor import capture

    torch.set_num_threads(1)
    F.linear = row_blocked_linear
    budget = int(os.environ[BUDGET_ENV])
    capture.default_max_batch_tokens = _fixed_budget(budget)


def _fixed_budget(budget: int) -> Callable[..., int]:
    def default_max_batch_tokens(*_: Any, **__: Any) -> int:
        return budget
    return default_max_batch_tokens


def reblocking_mismatches() -> list[str]:
    """What of the profile did not take in this process (empty when all did)."""
    from poolbench.extractor import capture

    wrong = []
    if torch.get_num_threads() != 1:
        wrong.append(f"torch runs {torch.get_num_threads()} threads, not 1")
    if F.linear is not row_blocked_linear:
        wrong.append("F.linear is not the row-blocked one")
    if capture.default_max_batch_tokens(0, 1) != int(os.environ.get(BUDGET_ENV, "0")):
        wrong.append(f"forwards without a named budget do not get {BUDGET_ENV}")
    return wrong
