"""A stand-in classifier B for steering tests: the share of a continuation's words that contain one letter, so a
test knows what every score is without training MiniLM."""

from __future__ import annotations

import numpy as np


class WordScorer:
    """Scores texts by the share of their words containing `letter`; `info` is what a trained scorer reports."""

    def __init__(self, concept: str, letter: str) -> None:
        self.letter = letter
        self.info = {"concept": concept, "key": f"stub-{concept}", "heldout_auroc": 1.0}

    def score(self, texts):
        return np.array([sum(self.letter in w for w in t.split()) / max(1, len(t.split())) for t in texts])
