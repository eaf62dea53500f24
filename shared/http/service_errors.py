"""The HTTP app's errors, each one status code: a request it cannot serve as asked (422; 400 on /v1/), a model,
scorer or stored vector it does not serve (404), its own configuration unusable (503). Each may name the request
field at fault (`param`), which /v1/'s OpenAI-shaped errors carry."""

from __future__ import annotations

from poolbench.errors import PoolBenchError


class ServiceError(PoolBenchError):
    """A one-line error that may name the request field at fault and an OpenAI error code."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class RequestError(ServiceError):
    """A well-formed request the service cannot serve as asked (too big, wrong layer): HTTP 422."""


class NotServed(ServiceError):
    """A model, scorer or stored vector this service was not configured with: HTTP 404."""


class ServiceConfigError(ServiceError):
    """The service's own configuration is unusable (no such run, a scorer artefact missing): HTTP 503."""
