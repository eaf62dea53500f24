"""In CI (CI=true) a skipped test fails the run, except `gpu` tests: a skip must never hide a missing install."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("gpu") is None):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run every non-gpu test: {reason}"
