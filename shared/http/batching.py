"""Requests waiting for the compute thread run as one batch per endpoint, grouped by the model or scorer they
name; each request gets its own answer, or its own error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from poolbench.compute_thread import ComputeThread
from poolbench.errors import PoolBenchError
from poolbench.http.settings import ServiceSettings

R = TypeVar("R")


def answer_grouped(reqs: Sequence[R], key: Callable[[R], str], use: Callable[[str], AbstractContextManager[Any]],
                   answer: Callable[[Any, list[R]], list]) -> list:
    """Requests grouped by the resource they name (a model, a scorer), each group answered under one hold of it;
    a resource that is not served or does not load answers every request of its group with that error."""
    out: list = [None] * len(reqs)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(key(r), []).append(i)
    for name, members in groups.items():
        try:
            with use(name) as resource:
                answers = answer(resource, [reqs[i] for i in members])
        except PoolBenchError as exc:
            answers = [exc] * len(members)
        for i, a in zip(members, answers, strict=True):
            out[i] = a
    return out


def answer_or_raise(result):
    """A batched call's answer, or its error raised for the exception handlers."""
    if isinstance(result, PoolBenchError):
        raise result
    return result


def batched(many, settings: ServiceSettings, compute: ComputeThread):
    """`many` (a list of requests -> their answers, blocking) as an awaitable of one request on the app's compute
    thread, run together with the other requests of `many` waiting there (ComputeThread.submit_batch). Not
    `@serve.batch`: it cuts a batch from one wait window's arrivals and queues it behind the running one, so under
    load it ran /generate batches of 1.3 requests while 30 requests waited (bench/README.md)."""

    async def one(req):
        return (await asyncio.wrap_future(compute.submit_batch(many, [req], max_items=settings.batch_size)))[0]

    return one
