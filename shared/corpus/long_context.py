"""The length axis: a test passage read inside k times its length of neutral text, probes trained at length 1.

`in_context(passage, k, seed)` puts the passage, unchanged, at a drawn place inside neutral sentences (corpus v2's
shared context templates, poolbench.corpus.sparse_signal.neutral_context) until the whole is about k times the
passage's words; the draw depends only on (seed, passage id, k), so every run reads the same long passages. The
passage's own character span is recorded as the signal span (`signal_spans`) and its place as the placement, so a
result can be read by where the signal sits. k = 1 returns the passage as it is.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from poolbench.corpus.passage import Passage
from poolbench.corpus.sparse_signal import neutral_context
from poolbench.errors import CorpusError


def _rng(seed: int, passage_id: str, k: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}|{passage_id}|{k}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def in_context(passage: Passage, k: int, seed: int = 0) -> Passage:
    """The passage inside neutral text making the whole about k x its word length (id suffixed "@k{k}")."""
    if k < 1:
        raise CorpusError(f"context length {k}: must be a whole multiple >= 1 of the passage's length")
    if k == 1:
        return passage
    rng = _rng(seed, passage.id, k)
    words = len(passage.text.split())
    neutral = neutral_context(rng, (k - 1) * words)
    cut = rng.randint(0, len(neutral))
    before, after = " ".join(neutral[:cut]), " ".join(neutral[cut:])
    start = len(before) + (1 if before else 0)
    text = " ".join(part for part in (before, passage.text, after) if part)
    place = start / max(len(text) - len(passage.text), 1)
    placement = "start" if place < 1 / 3 else ("end" if place > 2 / 3 else "middle")
    return replace(passage, id=f"{passage.id}@k{k}", text=text, signal_spans=((start, start + len(passage.text)),),
                   placement=placement, density=1, token_count=passage.token_count * k)
