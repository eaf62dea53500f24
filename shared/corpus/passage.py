"""Passage: one labelled text of a concept, as the PoolBench layout stores it."""

from __future__ import annotations

from dataclasses import dataclass

SPLITS = ("train", "test")
LABEL_NAMES = {1: "pos", 0: "neg"}


@dataclass(frozen=True)
class Passage:
    """A corpus record; `matched_pair_id` ties a positive to its controlled rewrite (None when unpaired)."""

    id: str
    text: str
    label: int
    domain: str
    token_count: int
    matched_pair_id: str | None
    split: str
    concept: str

    @property
    def group(self) -> str:
        """The CV group: a matched pair shares one, so a pair never straddles folds."""
        return self.matched_pair_id or self.id

    def to_record(self) -> dict:
        """The JSONL record of the PoolBench layout (the concept is implied by the folder)."""
        return {
            "id": self.id,
            "text": self.text,
            "label": self.label,
            "domain": self.domain,
            "token_count": self.token_count,
            "matched_pair_id": self.matched_pair_id,
            "split": self.split,
        }
