"""A request-body limit counted while the body streams in, so an oversized body is never read whole.

Content-Length alone is not enough: a chunked body declares no length. This pure ASGI middleware refuses a
declared length over the limit before reading a byte, and otherwise counts the bytes each `receive()` hands the
app, answering 413 as soon as they pass the limit (the app has then read at most the limit plus one chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def plain_refusal(path: str, message: str) -> tuple[int, dict]:
    return 413, {"detail": message}


class BodyTooLarge(HTTPException):
    """Raised inside `receive()`: FastAPI passes HTTPExceptions through its body parsing, so the 413 survives;
    `Connection: close` makes the server drop the rest of the body instead of reading it."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail, headers={"connection": "close"})


class BodyLimit:
    """Answer 413 (one-line JSON detail; `refusal` picks the body per path) for any HTTP request whose body passes
    `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 refusal: Callable[[str, str], tuple[int, dict]] = plain_refusal) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, *self.refusal(scope["path"], f"request body is {declared} bytes, at most "
                                                             f"{self.max_bytes}"))
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(f"request body passed {self.max_bytes} bytes while streaming "
                                       f"({received} read), at most {self.max_bytes}")
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:
            if started:
                raise
            await _refuse(send, *self.refusal(scope["path"], exc.detail))


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _refuse(send: Send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
