"""OpenAI's error shape on the /v1/ routes, `{"error": {"message", "type", "param", "code"}}`, at the status the
`openai` client maps to its exception classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError,
429 RateLimitError, 413 APIStatusError, 503 InternalServerError); PoolBench's own routes keep `{"detail": ...}`."""

from __future__ import annotations

import re

from poolbench.http.openai_schemas import ChatCompletionRequest, CompletionRequest

OPENAI_PREFIX = "/v1/"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "requests", 503: "service_unavailable"}
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
_NAMED = re.compile(r"^([A-Za-z_]\w*)((?:\.\w+|\[\d+\])*)\s*:")


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def param_of(message: str) -> str | None:
    """The request field a one-line message names first ('max_tokens: 65, at most 64' -> 'max_tokens'), when it is
    a field of the /v1/ bodies; None otherwise."""
    named = _NAMED.match(message)
    return named.group(1) + named.group(2) if named and named.group(1) in _FIELDS else None


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None
                 ) -> tuple[int, dict]:
    """(status, body) as OpenAI answers: a request PoolBench cannot serve as asked (422 on its own routes) is 400."""
    status = 400 if status == 422 else status
    return status, {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                              "param": param if param is not None else param_of(message), "code": code}}


def busy_refusal(path: str, message: str) -> tuple[int, dict]:
    """Admission control's answer to a request beyond its queue: 503 {"detail"}, or OpenAI's 429 on /v1/."""
    if is_openai_path(path):
        return openai_error(429, message, code="rate_limit_exceeded")
    return 503, {"detail": message}


def too_large_refusal(path: str, message: str) -> tuple[int, dict]:
    """The body limit's answer: 413 {"detail"}, or 413 in OpenAI's shape on /v1/."""
    if is_openai_path(path):
        return openai_error(413, message, code="request_too_large")
    return 413, {"detail": message}
