"""Backpressure: a few requests work, a bounded queue waits in order, the rest get 503 with Retry-After at once."""

from __future__ import annotations

import asyncio
import json

from poolbench.http.admission import Admission
from poolbench.http.openai_errors import busy_refusal


class Gate:
    """An ASGI app whose requests finish only when the test opens their gate; records the order they started."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send) -> None:
        name = scope["path"]
        self.started.append(name)
        await self.gates.setdefault(name, asyncio.Event()).wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app, path: str) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def test_two_work_two_wait_the_fifth_is_told_when_to_retry():
    async def scenario() -> None:
        inner = Gate()
        clock = iter(float(t) for t in range(1000))
        app = Admission(inner, workers=2, queue=2, clock=lambda: next(clock))
        tasks = [asyncio.create_task(call(app, f"/r{i}")) for i in range(4)]
        await asyncio.sleep(0)  # let the four reach the middleware
        await asyncio.sleep(0)
        assert inner.started == ["/r0", "/r1"] and app.working == 2 and app.waiting == 2
        status, headers, body = await call(app, "/r4")
        assert status == 503 and headers["retry-after"] == "1"  # (2 waiting + 2 working) / 2 x 0.5 s
        assert json.loads(body)["detail"] == "busy: 2 requests working and 2 queued (at most 2); retry after 1 s"
        inner.gates["/healthz"] = asyncio.Event()
        inner.gates["/healthz"].set()
        assert (await call(app, "/healthz"))[0] == 200  # open paths skip admission, even when it is full
        for name in ("/r0", "/r1"):
            inner.gates.setdefault(name, asyncio.Event()).set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert inner.started == ["/r0", "/r1", "/healthz", "/r2", "/r3"]  # the queue is served in order
        for name in ("/r2", "/r3"):
            inner.gates.setdefault(name, asyncio.Event()).set()
        assert [r[0] for r in await asyncio.gather(*tasks)] == [200, 200, 200, 200]
        assert app.working == 0 and app.waiting == 0

    asyncio.run(scenario())


def test_retry_after_follows_the_measured_service_time():
    app = Admission(Gate(), workers=2, queue=8)
    app.service_s, app.working, app.waiting = 3.0, 2, 8
    assert app.retry_after_s() == 15  # 10 requests ahead, 2 at a time, 3 s each


def test_a_full_queue_is_openai_s_429_on_v1_and_poolbench_s_503_elsewhere():
    async def scenario() -> None:
        inner = Gate()
        app = Admission(inner, workers=1, queue=0, refusal=busy_refusal)
        first = asyncio.create_task(call(app, "/generate"))
        await asyncio.sleep(0)
        status, headers, body = await call(app, "/v1/completions")
        assert status == 429 and headers["retry-after"] == "1"
        assert json.loads(body) == {"error": {"message": "busy: 1 requests working and 0 queued (at most 0); retry "
                                              "after 1 s", "type": "requests", "param": None,
                                              "code": "rate_limit_exceeded"}}
        status, _, body = await call(app, "/generate")
        assert status == 503 and set(json.loads(body)) == {"detail"}
        inner.gates["/generate"].set()
        assert (await first)[0] == 200

    asyncio.run(scenario())
