"""Scorer errors: one line naming the concept, artefact or encoder at fault."""

from __future__ import annotations

from poolbench.errors import PoolBenchError


class ScorerError(PoolBenchError):
    """A scorer that cannot be trained, loaded or used (missing or corrupt artefact, unknown encoder)."""


class WeakScorerError(ScorerError):
    """A scorer whose held-out AUROC is below the validity threshold (kept only with allow_weak)."""
