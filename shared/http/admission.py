"""Admission control for the HTTP app: a few requests work at once, a bounded queue waits, the rest get 503 at once.

Without it every request the proxy forwards takes a worker thread: dozens of threads contend for one model lock and
two cores, and clients wait in an unbounded queue. Here waiting costs an asyncio task, not a thread; a full queue is
answered immediately with 503 and a Retry-After that estimates when a slot frees, so a client backs off instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

Refusal = Callable[[str, str], tuple[int, dict]]
"""(path, one-line message) -> (status, JSON body) of a refused request."""


def plain_refusal(path: str, message: str) -> tuple[int, dict]:
    return 503, {"detail": message}


class Admission:
    """Pure ASGI middleware: `workers` requests run, up to `queue` wait (FIFO), beyond that 503 + Retry-After
    (`refusal` picks the status and body per path: OpenAI's 429 on /v1/)."""

    def __init__(self, app: ASGIApp, *, workers: int, queue: int, open_paths: tuple[str, ...] = ("/healthz",),
                 clock: Callable[[], float] = time.monotonic, refusal: Refusal = plain_refusal) -> None:
        self.app = app
        self.workers, self.queue = workers, queue
        self.open_paths = open_paths
        self.clock = clock
        self.refusal = refusal
        self.waiting = 0
        self.working = 0
        self.service_s = 0.5  # running mean of a request's service time, for Retry-After
        self._slots: asyncio.Semaphore | None = None

    def retry_after_s(self) -> int:
        """Seconds until the queue ahead of a new request has drained, at the recent service time; at least 1."""
        return max(1, math.ceil((self.waiting + self.working) / self.workers * self.service_s))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        if self.working >= self.workers and self.waiting >= self.queue:
            await self._refuse(scope["path"], send)
            return
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.working += 1
        started = self.clock()
        try:
            await self.app(scope, receive, send)
        finally:
            self.working -= 1
            self._slots.release()
            self.service_s = 0.9 * self.service_s + 0.1 * (self.clock() - started)

    async def _refuse(self, path: str, send: Send) -> None:
        retry = self.retry_after_s()
        status, content = self.refusal(path, f"busy: {self.working} requests working and {self.waiting} queued "
                                             f"(at most {self.queue}); retry after {retry} s")
        body = json.dumps(content).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", str(retry).encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
