"""Which concepts share a pooling job. On a GPU a concept of a few dozen passages leaves its last forwards partly
empty and pays a job's overhead (a Ray call, a model's worth of hooks, the store round trips) for little work, so
consecutive concepts are packed into one job up to a token target; on CPU each forward costs what its tokens
cost and the overhead is small beside it, so a job stays one concept."""

from __future__ import annotations

from collections.abc import Sequence

from poolbench.corpus.passage import Passage
from poolbench.extractor.batching import DEFAULT_MAX_BATCH_TOKENS

GROUP_FORWARDS = 16  # a group's default target: this many full forwards at the batch budget
CHARS_PER_TOKEN = 4  # the estimate for passages whose record carries no token_count


def group_token_target(requested: int | None, on_gpu: bool, max_batch_tokens: int | None) -> int:
    """`--concept-group-tokens` when given (0: one concept per job); else, on a GPU, GROUP_FORWARDS forwards' worth
    of the batch budget (so a group's partly filled last forward is a small share of it), and 0 on CPU."""
    if requested is not None:
        return requested
    return GROUP_FORWARDS * (max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS) if on_gpu else 0


def estimated_tokens(passages: Sequence[Passage], max_length: int) -> int:
    """The tokens a concept puts through the model, from each record's token_count (its characters / 4 where that
    is 0), cut at max_length: a packing estimate, never a limit."""
    return sum(min(p.token_count if p.token_count > 0 else len(p.text) // CHARS_PER_TOKEN + 1, max_length)
               for p in passages)


def plan_groups(tokens: Sequence[int], target: int, n_workers: int = 1) -> list[list[int]]:
    """Consecutive concepts (indices into `tokens`) packed in order: a group closes before the concept that
    would take it past `target`, and a concept above the target forms its own. With several workers the target
    is also held to an even share of all tokens, so no worker waits while another holds one large group.
    `target` 0 gives one concept per group."""
    if target <= 0:
        return [[i] for i in range(len(tokens))]
    share = -(-sum(tokens) // max(n_workers, 1))
    limit = max(1, min(target, share))
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(tokens):
        if groups and size + n <= limit:
            groups[-1].append(i)
            size += n
        else:
            groups.append([i])
            size = n
    return groups
