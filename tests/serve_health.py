"""Wait for a Serve app the test started: its /healthz answers 200, or the test fails in one line."""

from __future__ import annotations

import time

import httpx


def wait_healthy(base: str, timeout_s: float) -> None:
    """Poll BASE/healthz until it answers 200; fail once TIMEOUT_S has passed without it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"Serve app did not come up in {timeout_s:g} s"
        time.sleep(0.2)
