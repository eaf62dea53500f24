"""Passage: one labelled text of a concept, as the PoolBench layout stores it."""

from __future__ import annotations

from dataclasses import dataclass, replace

SPLITS = ("train", "test")
LABEL_NAMES = {1: "pos", 0: "neg"}
PLACEMENTS = ("start", "middle", "end", "spread")
"""Where a passage's concept-bearing sentences sit (corpus v2); `spread` spaces them across the passage."""
TIERS = ("standard", "hard")
"""A pair's tier: `hard` pairs hold the same words on both sides and differ only in what they mean together."""


@dataclass(frozen=True)
class Passage:
    """A corpus record; `matched_pair_id` ties a positive to its controlled rewrite (None when unpaired).

    `signal_spans`, `density` and `placement` are optional: a corpus that marks where its concept is (v2)
    records the character spans of the concept-bearing sentences (of the rewrite, in a negative), their count
    and their placement, so results can be read by density and position. `tier` (optional, one of TIERS) lets
    results be read per tier.
    """

    id: str
    text: str
    label: int
    domain: str
    token_count: int
    matched_pair_id: str | None
    split: str
    concept: str
    signal_spans: tuple[tuple[int, int], ...] | None = None
    density: int | None = None
    placement: str | None = None
    tier: str | None = None

    @property
    def group(self) -> str:
        """The CV group: a matched pair shares one, so a pair never straddles folds."""
        return self.matched_pair_id or self.id

    def to_record(self) -> dict:
        """The JSONL record of the PoolBench layout (the concept is implied by the folder); optional fields
        appear only when set, so a corpus without them writes exactly the v1 records."""
        record = {
            "id": self.id,
            "text": self.text,
            "label": self.label,
            "domain": self.domain,
            "token_count": self.token_count,
            "matched_pair_id": self.matched_pair_id,
            "split": self.split,
        }
        if self.signal_spans is not None:
            record["signal_spans"] = [list(span) for span in self.signal_spans]
        if self.density is not None:
            record["density"] = self.density
        if self.placement is not None:
            record["placement"] = self.placement
        if self.tier is not None:
            record["tier"] = self.tier
        return record


def signal_only(passage: Passage) -> Passage:
    """The passage cut down to its signal sentences (itself when unmarked): what a short-window classifier such as
    the steering scorer must see, since a v2 passage's signal may sit past its first 64 tokens."""
    if not passage.signal_spans:
        return passage
    text = " ".join(passage.text[a:b] for a, b in passage.signal_spans)
    spans, at = [], 0
    for a, b in passage.signal_spans:
        spans.append((at, at + b - a))
        at += b - a + 1
    return replace(passage, text=text, token_count=len(text.split()), signal_spans=tuple(spans))
