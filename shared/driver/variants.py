"""A run's cell axes beside layers (issue 44): the activation site and the context length.

Each Variant is one pass of pooling and probing over every concept. The main one (the residual site, length 1) is
the run's own: its keys, cells, leaderboard and answer are those of a run without the axes. Each other site is
read at length 1, each other length at the residual site (not the cross product: every variant costs a full
pooling pass). A variant's pooled key adds its site / context length, so the main variant's keys never change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from poolbench.config import RESIDUAL_SITE as RESIDUAL
from poolbench.config import RunConfig
from poolbench.corpus.long_context import in_context
from poolbench.corpus.passage import Passage
from poolbench.records.d1 import D1CellRecord


@dataclass(frozen=True)
class Variant:
    site: str = RESIDUAL
    context_length: int = 1

    @property
    def main(self) -> bool:
        return self.site == RESIDUAL and self.context_length == 1

    @property
    def name(self) -> str:
        return "main" if self.main else self.site if self.context_length == 1 else f"k{self.context_length}"

    def key_fields(self) -> dict[str, str | int]:
        """What the variant adds to a pooled key: nothing for the main variant, so its keys stay as they were."""
        return {**({"site": self.site} if self.site != RESIDUAL else {}),
                **({"context_length": self.context_length} if self.context_length != 1 else {})}

    def max_length(self, max_length: int) -> int:
        """A lengthened passage is truncated at k x the run's max length, so its own text is never cut off."""
        return max_length * self.context_length

    def passages(self, passages: Sequence[Passage], seed: int) -> list[Passage]:
        """Train passages as they are (probes train at length 1); each test passage inside k x its length."""
        return [p if p.split != "test" else in_context(p, self.context_length, seed) for p in passages]

    def tag(self, record: D1CellRecord) -> D1CellRecord:
        """The record with its site and context length set (left unset on the main variant's records)."""
        if self.main:
            return record
        return D1CellRecord.from_dict({**record.to_dict(), "site": self.site, "context_length": self.context_length})


MAIN = Variant()


def axis_variants(cfg: RunConfig) -> list[Variant]:
    """The variants a run adds to its main one: every other site at length 1, every other length at the residual."""
    return ([Variant(site=site) for site in cfg.sites if site != RESIDUAL]
            + [Variant(context_length=k) for k in cfg.context_lengths if k != 1])
