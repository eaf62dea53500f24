"""The HTTP app's errors, each one status code: a request it cannot serve as asked (422), a model or scorer
it does not serve (404), its own configuration unusable (503)."""

from __future__ import annotations

from poolbench.errors import PoolBenchError


class RequestError(PoolBenchError):
    """A well-formed request the service cannot serve as asked (too big, wrong layer): HTTP 422."""


class NotServed(PoolBenchError):
    """A model or scorer this service was not configured with: HTTP 404."""


class ServiceConfigError(PoolBenchError):
    """The service's own configuration is unusable (no such run, a scorer artefact missing): HTTP 503."""
