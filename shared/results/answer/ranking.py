"""Intervals over concepts and Nemenyi's critical-difference groups (drawn in the CD figure, never a verdict): the
light statistics the printed leaderboard, the run's answer and the report share (numpy and scipy only, so the CLI
can import them without matplotlib)."""

from __future__ import annotations

import string
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

CI_LEVEL = 0.95
# A t-interval over two concepts rests on one degree of freedom (t = 12.7): it is reported as n/a, not drawn.
MIN_CONCEPTS_FOR_INTERVAL = 3


def mean_t_interval(values: Sequence[float], level: float = CI_LEVEL, *, clip: bool = True
                    ) -> tuple[float, float | None, float | None]:
    """Mean AUROC with a Student-t interval treating the values (one per concept) as a sample, clipped to the
    AUROC's [0, 1] (`clip=False` for a difference of AUROCs, which may be negative); no interval from fewer than
    three values."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    if v.size < MIN_CONCEPTS_FOR_INTERVAL:
        return mean, None, None
    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size))
    return (mean, max(0.0, mean - half), min(1.0, mean + half)) if clip else (mean, mean - half, mean + half)


def tie_groups(average_ranks: Mapping[str, float], cd: float) -> list[list[str]]:
    """Maximal runs of strategies (by average rank) spanning at most the critical difference: Nemenyi cannot
    tell members of one group apart at the test's alpha. A strategy in no shared group stands alone."""
    names = sorted(average_ranks, key=lambda s: (average_ranks[s], s))
    values = [average_ranks[s] for s in names]
    groups, reach = [], -1
    for i in range(len(names)):
        j = i
        while j + 1 < len(names) and values[j + 1] - values[i] <= cd:
            j += 1
        if j > reach:
            groups.append(names[i:j + 1])
            reach = j
    return groups


def group_letters(groups: Sequence[Sequence[str]]) -> dict[str, str]:
    """Compact letter display: strategies sharing a letter lie within one Nemenyi critical difference."""
    letters: dict[str, str] = defaultdict(str)
    for n, group in enumerate(groups):
        letter = string.ascii_lowercase[n % 26] + (str(n // 26) if n >= 26 else "")
        for s in group:
            letters[s] += letter
    return dict(letters)
