"""Float tolerances from the arithmetic, not from one machine: two float32 evaluations of one quantity that differ
only in the order of their roundings (another CPU's kernels, a batch of 4 vs a batch of 1) differ by about
eps·|partial sums|·√n for n roundings, so a comparison allows a few of those widths of the magnitude compared."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: the spacing of float32 numbers in [1, 2)

# Standard widths allowed. A rounding errs by at most eps/2 of the value rounded; n independent roundings add like
# a random walk (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §2.8 and §4.2), so one order's
# error is about eps/2·scale·√n and the gap between two orders about eps/√2·scale·√n: k = 4 leaves more than 5
# of those widths, while a real bug (a row mixed with another, a token left out) moves values by far more.
WIDTHS = 4.0


def float32_atol(scale: float, terms: int = 1, k: float = WIDTHS) -> float:
    """The absolute gap allowed between two float32 evaluations of one result made of `terms` roundings of values
    at most `scale` in size (the operands' magnitude, not the result's: a sum that cancels to ~0 keeps the
    round-off of its terms)."""
    if terms < 1 or scale < 0:
        raise ValueError(f"terms must be >= 1 and scale >= 0, got terms={terms}, scale={scale}")
    return k * EPS32 * scale * math.sqrt(terms)


def assert_float32_close(actual: ArrayLike, expected: ArrayLike, *, terms: int = 1,
                         scale: float | ArrayLike | None = None, k: float = WIDTHS, err_msg: str = "") -> None:
    """|actual - expected| <= float32_atol(scale, terms, k) elementwise (`scale` may be an array, one per entry);
    `scale` defaults to the largest magnitude on either side, which stands for the operands' magnitude when the
    result does not cancel."""
    a, b = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"{err_msg}: shapes differ, {a.shape} vs {b.shape}")
    if scale is None:
        scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
    scales = np.broadcast_to(np.asarray(scale, dtype=np.float64), a.shape)
    if terms < 1 or (scales < 0).any():
        raise ValueError(f"terms must be >= 1 and scale >= 0, got terms={terms}, min scale={scales.min()}")
    allowed = k * EPS32 * scales * math.sqrt(terms)
    gap = np.abs(a - b)
    bad = ~(gap <= allowed)  # NaN on either side is bad
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, gap / np.maximum(allowed, 1e-300), -1.0)), a.shape)
        raise AssertionError(
            f"{err_msg}: {int(bad.sum())} of {a.size} entries differ by more than {k:g} widths of eps32·scale·"
            f"√{terms}; worst at {tuple(int(i) for i in worst)}: {a[worst]!r} vs {b[worst]!r}, gap {gap[worst]:.3g} > "
            f"allowed {allowed[worst]:.3g} (scale {scales[worst]:.3g})")


def assert_weighted_mean_close(actual: ArrayLike, expected: ArrayLike, values: ArrayLike, n: int,
                               err_msg: str = "") -> None:
    """A weighted mean Σw·x/Σw (w >= 0) of at most n of `values`: n multiply-adds, the weights' sum and the
    division, each rounding relative to at most max|x| (every partial sum of w·x/Σw is), so n + 2 roundings of
    max|values| — the values pooled, not the mean, which may cancel to ~0."""
    assert_float32_close(actual, expected, terms=n + 2, scale=float(np.abs(np.asarray(values)).max()),
                         err_msg=err_msg)


def assert_pooled_close(actual: ArrayLike, expected: ArrayLike, batch: Any, err_msg: str = "") -> None:
    """Pooled vectors of an ActivationBatch are weighted means of a passage's real token rows (at most T of them):
    the bound above over its real token values; padding (often ±99 in tests) is no operand."""
    hidden, mask = np.asarray(batch.hidden), np.asarray(batch.attention_mask)
    assert_weighted_mean_close(actual, expected, hidden[:, mask], hidden.shape[2], err_msg=err_msg)


def assert_records_close(actual: Any, expected: Any, *, rel: float, err_msg: str = "") -> None:
    """Two records (nested dicts and lists from to_dict()) made by computations that round in other orders: every
    key, string, int, bool and None equal exactly; every float within `rel` of the larger magnitude of the two (the
    caller derives `rel` from the chain that made the floats, e.g. 2·float32_atol(log-scale, terms) for a ratio of
    perplexities, exponentials of mean token log-probabilities)."""
    if isinstance(actual, dict) and isinstance(expected, dict):
        if actual.keys() != expected.keys():
            raise AssertionError(f"{err_msg}: keys differ, {sorted(actual)} vs {sorted(expected)}")
        for key in actual:
            assert_records_close(actual[key], expected[key], rel=rel, err_msg=f"{err_msg}.{key}")
    elif isinstance(actual, list) and isinstance(expected, list):
        if len(actual) != len(expected):
            raise AssertionError(f"{err_msg}: lengths differ, {len(actual)} vs {len(expected)}")
        for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
            assert_records_close(a, b, rel=rel, err_msg=f"{err_msg}[{i}]")
    elif isinstance(actual, float) and isinstance(expected, float):
        if math.isnan(actual) and math.isnan(expected):
            return
        if not abs(actual - expected) <= rel * max(abs(actual), abs(expected)) and actual != expected:
            raise AssertionError(f"{err_msg}: {actual!r} vs {expected!r} differ by more than {rel:.3g} of their "
                                 f"size")
    elif type(actual) is not type(expected) or actual != expected:
        raise AssertionError(f"{err_msg}: {actual!r} vs {expected!r}")
