"""CE-Bench data: contrastive story pairs about one subject, its mentions marked by character spans.

File format (JSONL, UTF-8, one entry per line, blank lines skipped)::

    {"id": "ce-0001", "subject": "the lighthouse",
     "story_a": "The lighthouse stood bright ...", "story_b": "The lighthouse stood dark ...",
     "spans_a": [[0, 14], [40, 53]], "spans_b": [[0, 14]]}

- ``id``: non-empty string, unique in the file.
- ``subject``: non-empty string, what the stories are about.
- ``story_a`` / ``story_b``: the two contrastive paragraphs (non-empty strings).
- ``spans_a`` / ``spans_b``: the marked spans of each story, ``[start, end)`` character offsets into that
  story (Python string indices, ``0 <= start < end <= len(story)``), at least one per story; they may
  overlap.
- ``meta``: optional JSON object, carried along and never read.

Character spans, not inline markers: a story stays exactly the text the model reads, and any tokenizer's
offsets mapping aligns tokens to spans (a token is marked when its character span overlaps a marked span).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poolbench.atomic_write import write_text_atomic
from poolbench.errors import PoolBenchError

REQUIRED_FIELDS = ("id", "subject", "story_a", "story_b", "spans_a", "spans_b")
OPTIONAL_FIELDS = ("meta",)


class CEBenchDataError(PoolBenchError):
    """A CE-Bench dataset file or entry that is missing or malformed."""


@dataclass(frozen=True)
class CEBenchEntry:
    """One subject with two contrastive paragraphs and the character spans that mention the subject."""

    id: str
    subject: str
    story_a: str
    story_b: str
    spans_a: tuple[tuple[int, int], ...]
    spans_b: tuple[tuple[int, int], ...]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id, "subject": self.subject, "story_a": self.story_a,
                                  "story_b": self.story_b, "spans_a": [list(s) for s in self.spans_a],
                                  "spans_b": [list(s) for s in self.spans_b]}
        if self.meta:
            record["meta"] = self.meta
        return record


def _spans(record: dict, name: str, story: str) -> tuple[tuple[int, int], ...]:
    value = record[name]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name}: expected a non-empty list of [start, end] pairs")
    spans = []
    for i, span in enumerate(value):
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
            raise ValueError(f"{name}[{i}]: expected [start, end] integers, got {span!r:.40}")
        start, end = span
        if not 0 <= start < end <= len(story):
            raise ValueError(f"{name}[{i}]: span {span} is not within 0 <= start < end <= {len(story)}")
        spans.append((start, end))
    return tuple(spans)


def parse_entry(record: object) -> CEBenchEntry:
    """A validated entry; raises ValueError('field: problem') naming the first bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"entry: expected a JSON object, got {type(record).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in record:
            raise ValueError(f"{name}: missing field")
    unknown = sorted(set(record) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field (expected {', '.join(REQUIRED_FIELDS)}, meta)")
    for name in ("id", "subject", "story_a", "story_b"):
        if not isinstance(record[name], str) or not record[name].strip():
            raise ValueError(f"{name}: expected a non-empty string, got {record[name]!r:.40}")
    meta = record.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"meta: expected a JSON object, got {type(meta).__name__}")
    return CEBenchEntry(id=record["id"], subject=record["subject"], story_a=record["story_a"],
                        story_b=record["story_b"], spans_a=_spans(record, "spans_a", record["story_a"]),
                        spans_b=_spans(record, "spans_b", record["story_b"]), meta=meta)


def load_cebench(path: str | Path) -> list[CEBenchEntry]:
    """Every entry of a CE-Bench JSONL file; the first malformed line is a one-line error naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise CEBenchDataError(f"{path}: no such CE-Bench file")
    entries: list[CEBenchEntry] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CEBenchDataError(f"{path}:{line_no}: invalid JSON ({exc.msg} at column {exc.colno})") \
                    from None
            try:
                entry = parse_entry(record)
            except ValueError as exc:
                raise CEBenchDataError(f"{path}:{line_no}: {exc}") from None
            if entry.id in seen:
                raise CEBenchDataError(f"{path}:{line_no}: id: {entry.id!r} already used on line "
                                       f"{seen[entry.id]}")
            seen[entry.id] = line_no
            entries.append(entry)
    if len(entries) < 2:
        raise CEBenchDataError(f"{path}: {len(entries)} entries; CE-Bench normalises over the dataset and "
                               "needs at least 2")
    return entries


def write_cebench(path: str | Path, entries: Iterable[CEBenchEntry]) -> None:
    """Write entries as JSONL atomically (a reader sees the old file or the new one)."""
    write_text_atomic(Path(path), "".join(json.dumps(e.to_json(), ensure_ascii=False) + "\n" for e in entries))


# The generator: each subject gets two stories that differ in one contrast (bright/dark, calm/angry, ...),
# the subject named two or three times in each. Sentences are plain, so the embedded model's BPE copes.
_SUBJECTS = ("the lighthouse", "the old bridge", "the baker", "the river", "the orchestra",
             "the village school", "the red car", "the garden", "the night train", "the library",
             "the fisherman", "the mountain road",
             "the market", "the harbour", "the teacher", "the wooden boat", "the museum", "the farmer",
             "the kitchen", "the city council", "the old captain", "the small café", "the bicycle",
             "the museum guide")
_CONTRASTS = (
    ("bright", "warm", "everyone smiled", "dark", "cold", "everyone shivered"),
    ("calm", "quiet", "the morning felt gentle", "angry", "loud", "the morning felt tense"),
    ("new", "clean", "people admired it", "old", "broken", "people ignored it"),
    ("busy", "crowded", "nobody could sit down", "empty", "silent", "nobody came at all"),
    ("fast", "early", "the trip was short", "slow", "late", "the trip took hours"),
    ("rich", "generous", "the gifts were many", "poor", "careful", "the coins were few"),
)
_FORMS_OPEN = ("{S} was {x} on Monday.", "Everyone agreed that {s} was {x}.", "In the spring {s} seemed {x}.")
_FORMS_MID = ("It was {y} near {s}, and {z}.", "Around {s} it was {y}; {z}.", "By noon it was {y}, and {z}.")
_FORMS_CLOSE = ("Later, {s} stayed {x}.", "At night {s} was still {x}.", "In the end {s} remained {x}.")


def _fill(form: str, subject: str, x: str, y: str, z: str) -> tuple[str, list[tuple[int, int]]]:
    """The sentence with `subject` in place of {s}/{S}, and the subject's character spans in it."""
    text, spans, i = "", [], 0
    while i < len(form):
        if form.startswith(("{s}", "{S}"), i):
            word = subject if form[i + 1] == "s" else subject[0].upper() + subject[1:]
            spans.append((len(text), len(text) + len(word)))
            text += word
            i += 3
        elif form.startswith(("{x}", "{y}", "{z}"), i):
            text += {"x": x, "y": y, "z": z}[form[i + 1]]
            i += 3
        else:
            text += form[i]
            i += 1
    return text, spans


def _story(rng: random.Random, subject: str, x: str, y: str,
           z: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    story, spans = "", []
    for forms in (_FORMS_OPEN, _FORMS_MID, _FORMS_CLOSE):
        sentence, local = _fill(rng.choice(forms), subject, x, y, z)
        offset = len(story) + (1 if story else 0)
        story = f"{story} {sentence}" if story else sentence
        spans.extend((offset + a, offset + b) for a, b in local)
    return story, tuple(spans)


def generate_cebench(n_entries: int = 48, *, seed: int = 0) -> list[CEBenchEntry]:
    """Deterministic CE-Bench entries: subjects cycle, each with a seeded contrast and sentence forms."""
    if n_entries < 2:
        raise CEBenchDataError(f"generate_cebench: n_entries={n_entries}; CE-Bench needs at least 2")
    rng = random.Random(seed)
    entries = []
    for i in range(n_entries):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        xa, ya, za, xb, yb, zb = rng.choice(_CONTRASTS)
        state = rng.getstate()
        story_a, spans_a = _story(rng, subject, xa, ya, za)
        rng.setstate(state)  # the same sentence forms on both sides: the stories differ only in the contrast
        story_b, spans_b = _story(rng, subject, xb, yb, zb)
        entries.append(CEBenchEntry(id=f"ce-{i:04d}", subject=subject, story_a=story_a, story_b=story_b,
                                    spans_a=spans_a, spans_b=spans_b))
    return entries


def entry_texts(entries: Sequence[CEBenchEntry]) -> tuple[list[str], list[tuple[tuple[int, int], ...]]]:
    """All stories in order a0, b0, a1, b1, ... with their spans: the order the scorer expects."""
    texts, spans = [], []
    for entry in entries:
        texts += [entry.story_a, entry.story_b]
        spans += [entry.spans_a, entry.spans_b]
    return texts, spans
