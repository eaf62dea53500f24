"""CE-Bench scores on neurons or SAE features: arrays in, arrays out (no model, no I/O).

For each entry (a pair of contrastive paragraphs about one subject) four mean vectors are formed from a
layer's token activations (special tokens excluded): the mean over all tokens of paragraph A, of paragraph
B, over the marked tokens of both paragraphs, and over the unmarked tokens of both.

"Normalise jointly" means: per feature, min-max scale with the minimum and maximum taken over the stacked
vectors of the *whole dataset* — all 2E paragraph means for the contrastive score, all 2E marked/unmarked
means for the independent score — so the two vectors of an entry share one scale, one scale per feature.
Min-max over only the two vectors of a pair would be degenerate: each feature becomes 0 and 1 (or 0 and 0), so
|difference| is 1 wherever the two differ at all and the max is always 1. Dataset-level min-max keeps every
feature in [0, 1] (so neurons and SAE features of any scale are comparable, and the max is bounded) while an
entry's |difference| says how much of that feature's whole range across the dataset the contrast spans.
A feature constant over the stack (for SAE features: never active) scales to 0.

Per entry the score is the max over features of |difference|; the dataset score is the mean over entries.
Per feature, the mean over entries of |difference|; interpretability = contrastive + independent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from poolbench.errors import PoolBenchError


class CEBenchError(PoolBenchError):
    """Activations or masks that CE-Bench cannot score."""


@dataclass
class CEBenchMeans:
    """The four mean vectors of each of E entries, [E, m] float64 each."""

    story_a: np.ndarray
    story_b: np.ndarray
    marked: np.ndarray
    unmarked: np.ndarray


@dataclass
class CEBenchScores:
    """Dataset scores (mean over entries of the per-entry max), per-entry and per-feature values."""

    contrastive: float
    independent: float
    interpretability: float
    entry_contrastive: np.ndarray  # [E] max over features of |a - b| (normalised)
    entry_independent: np.ndarray  # [E] max over features of |marked - unmarked| (normalised)
    entry_contrastive_feature: np.ndarray  # [E] int, the argmax feature
    entry_independent_feature: np.ndarray  # [E] int
    feature_contrastive: np.ndarray  # [m] mean over entries of |a - b|
    feature_independent: np.ndarray  # [m] mean over entries of |marked - unmarked|

    @property
    def feature_interpretability(self) -> np.ndarray:
        return self.feature_contrastive + self.feature_independent

    def top_features(self, k: int = 10) -> list[dict[str, float | int]]:
        """The k features with the highest mean interpretability, with how often each is an entry's argmax."""
        order = np.argsort(-self.feature_interpretability, kind="stable")[:k]
        return [{"feature": int(j), "contrastive": float(self.feature_contrastive[j]),
                 "independent": float(self.feature_independent[j]),
                 "interpretability": float(self.feature_interpretability[j]),
                 "argmax_contrastive_entries": int((self.entry_contrastive_feature == j).sum()),
                 "argmax_independent_entries": int((self.entry_independent_feature == j).sum())}
                for j in order]


def entry_means(stories: Sequence[np.ndarray], marked: Sequence[np.ndarray],
                ids: Sequence[str]) -> CEBenchMeans:
    """Mean vectors from per-story token activations [T_i, m] (special tokens already dropped) ordered a0, b0,
    a1, b1, ...; `marked[i]` is story i's [T_i] bool mask. An entry lacking marked or unmarked tokens is an
    error."""
    if len(stories) != 2 * len(ids) or len(marked) != len(stories):
        raise CEBenchError(f"entry_means: {len(stories)} stories and {len(marked)} masks for "
                           f"{len(ids)} entries")
    a, b, on, off = [], [], [], []
    for e, entry_id in enumerate(ids):
        xa, xb = (np.asarray(x, dtype=np.float64) for x in stories[2 * e: 2 * e + 2])
        ma, mb = (np.asarray(m, dtype=bool) for m in marked[2 * e: 2 * e + 2])
        if len(xa) == 0 or len(xb) == 0:
            raise CEBenchError(f"entry {entry_id!r}: a story has no tokens")
        if ma.shape != xa.shape[:1] or mb.shape != xb.shape[:1]:
            raise CEBenchError(f"entry {entry_id!r}: marked masks do not match the stories' token counts")
        tokens, mask = np.concatenate([xa, xb]), np.concatenate([ma, mb])
        if not mask.any():
            raise CEBenchError(f"entry {entry_id!r}: no token overlaps a marked span")
        if mask.all():
            raise CEBenchError(f"entry {entry_id!r}: every token is marked, none left unmarked")
        a.append(xa.mean(axis=0))
        b.append(xb.mean(axis=0))
        on.append(tokens[mask].mean(axis=0))
        off.append(tokens[~mask].mean(axis=0))
    return CEBenchMeans(np.stack(a), np.stack(b), np.stack(on), np.stack(off))


def normalise_jointly(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature min-max over the stack of both [E, m] arrays (all 2E vectors), applied to both.

    Constant features map to 0. See the module docstring for why the stack is the dataset, not the pair.
    """
    stack = np.concatenate([first, second])
    if len(stack) < 4:
        raise CEBenchError(f"normalise_jointly: {len(first)} entries; dataset-level min-max needs at least 2")
    low, high = stack.min(axis=0), stack.max(axis=0)
    span = high - low
    scale = np.divide(1.0, span, out=np.zeros_like(span), where=span > 0)
    return (first - low) * scale, (second - low) * scale


def cebench_scores(means: CEBenchMeans) -> CEBenchScores:
    """Contrastive, independent and interpretability scores from the entries' mean vectors."""
    a, b = normalise_jointly(means.story_a, means.story_b)
    on, off = normalise_jointly(means.marked, means.unmarked)
    contrast, independent = np.abs(a - b), np.abs(on - off)
    entry_c, entry_i = contrast.max(axis=1), independent.max(axis=1)
    c, i = float(entry_c.mean()), float(entry_i.mean())
    return CEBenchScores(
        contrastive=c, independent=i, interpretability=c + i,
        entry_contrastive=entry_c, entry_independent=entry_i,
        entry_contrastive_feature=contrast.argmax(axis=1),
        entry_independent_feature=independent.argmax(axis=1),
        feature_contrastive=contrast.mean(axis=0), feature_independent=independent.mean(axis=0),
    )
