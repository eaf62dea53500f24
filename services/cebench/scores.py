"""CE-Bench scores on neurons or SAE features: arrays in, arrays out (no model, no I/O).

For each entry (a pair of contrastive paragraphs about one subject) four mean vectors are formed from a
layer's token activations (special tokens excluded): the mean over all tokens of paragraph A, of paragraph
B, over the marked tokens of both paragraphs, and over the unmarked tokens of both. The contrastive distance
is |A - B| per feature, the independent distance |marked - unmarked|.

Two "joint normalisations" are offered:
- `entry_zscore` (the default: the published CE-Bench code, Gulko, Peng & Kumar 2025): per entry, the distance
  vector is z-scored across the entry's features (minus its mean, over its sample standard deviation; a
  constant vector divides by 1) and the entry's score is the max z. Interpretability z-scores the summed
  distances (contrastive + independent) the same way. A score is then "how many standard deviations the most
  contrastive feature stands out from the others" — scale-free per entry, comparable across layers and SAEs.
- `dataset_minmax` (PoolBench's earlier reading): per feature, min-max over the stacked vectors of the whole
  dataset, so each feature lies in [0, 1] and an entry's |difference| says how much of that feature's range the
  contrast spans; interpretability = contrastive + independent. Kept as an option for comparison.
Dataset scores are means over entries of the per-entry max; per-feature values are means over entries.
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
    feature_contrastive: np.ndarray  # [m] mean over entries of the normalised |a - b|
    feature_independent: np.ndarray  # [m] mean over entries of the normalised |marked - unmarked|
    feature_interpretability: np.ndarray  # [m] mean over entries of the normalised interpretability
    normalisation: str = "entry_zscore"

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


NORMALISATIONS = ("entry_zscore", "dataset_minmax")


def entry_zscore(distance: np.ndarray) -> np.ndarray:
    """Each row [E, m] minus its mean over features, over its sample std (ddof=1; a constant row divides by 1)."""
    centred = distance - distance.mean(axis=1, keepdims=True)
    std = centred.std(axis=1, ddof=1, keepdims=True)
    return centred / np.where(std > 0, std, 1.0)


def cebench_scores(means: CEBenchMeans, normalisation: str = "entry_zscore") -> CEBenchScores:
    """Contrastive, independent and interpretability scores from the entries' mean vectors."""
    if normalisation == "entry_zscore":
        contrast_d, independent_d = np.abs(means.story_a - means.story_b), np.abs(means.marked - means.unmarked)
        contrast, independent = entry_zscore(contrast_d), entry_zscore(independent_d)
        interpret = entry_zscore(contrast_d + independent_d)
    elif normalisation == "dataset_minmax":
        a, b = normalise_jointly(means.story_a, means.story_b)
        on, off = normalise_jointly(means.marked, means.unmarked)
        contrast, independent = np.abs(a - b), np.abs(on - off)
        interpret = contrast + independent
    else:
        raise CEBenchError(f"normalisation must be one of {', '.join(NORMALISATIONS)}, got '{normalisation}'")
    entry_c, entry_i = contrast.max(axis=1), independent.max(axis=1)
    c, i = float(entry_c.mean()), float(entry_i.mean())
    overall = float(interpret.max(axis=1).mean()) if normalisation == "entry_zscore" else c + i
    return CEBenchScores(
        contrastive=c, independent=i, interpretability=overall,
        entry_contrastive=entry_c, entry_independent=entry_i,
        entry_contrastive_feature=contrast.argmax(axis=1),
        entry_independent_feature=independent.argmax(axis=1),
        feature_contrastive=contrast.mean(axis=0), feature_independent=independent.mean(axis=0),
        feature_interpretability=interpret.mean(axis=0), normalisation=normalisation,
    )
