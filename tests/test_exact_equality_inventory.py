"""Issue 41's inventory: every exact-equality site in the tests is listed in tests/exact_equality_sites.py with the
reason exact is right there, so a new bit-for-bit claim between two computations cannot land unexplained."""

from __future__ import annotations

from pathlib import Path

from exact_equality import scan_source, scan_tests
from exact_equality_sites import COPY, EXACT, INTS, SAME, SITES

TESTS = Path(__file__).parent


def test_every_exact_equality_site_in_the_tests_is_listed_with_its_reason() -> None:
    found = scan_tests(TESTS)
    listed = {site: count for site, (count, _, _) in SITES.items()}
    unlisted = {site: n for site, n in found.items() if listed.get(site) != n}
    stale = {site: n for site, n in listed.items() if found.get(site) != n}
    assert not unlisted, (f"exact-equality sites not in tests/exact_equality_sites.py (or counted otherwise): "
                          f"{unlisted}; compare two computations within tests/tolerances.py's bound, or list the "
                          f"site with why exact is right (docs/reproducibility.md)")
    assert not stale, f"listed sites no longer in the tests: {stale}"


def test_every_reason_is_one_of_the_four_kinds() -> None:
    for site, (_, reason, what) in SITES.items():
        assert any(reason.startswith(kind) for kind in (INTS, EXACT, COPY, SAME)) or "exactly" in reason \
            or "no reduction" in reason, site
        assert what, site


def test_the_scan_finds_each_kind_of_site_and_skips_claims_of_difference() -> None:
    """Should-fail side: a planted bit-for-bit comparison of two batch shapes is found."""
    source = '''
import numpy as np, torch
def test_planted(a, b, t):
    np.testing.assert_array_equal(a, b)
    assert np.array_equal(a, b) and torch.equal(a, b) and t.equals(t)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not np.array_equal(a, b)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert p.read_bytes() == q.read_bytes()
def helper():
    def inner(a, b):
        return np.array_equal(a, b)
'''
    assert scan_source(source) == {"test_planted": 7, "helper": 1}
