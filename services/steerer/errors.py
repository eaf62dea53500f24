"""Steering errors: one line naming the concept, strategy, grid or file at fault."""

from __future__ import annotations

from poolbench.errors import PoolBenchError


class SteeringError(PoolBenchError):
    """Bad steering input (unknown concept/strategy/layer, bad alpha grid, empty prompts) or backend trouble."""


class EngineDied(SteeringError):
    """A generation engine died, its own cause in the one line: the server's fault (HTTP 503), not the request's."""
