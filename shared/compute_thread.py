"""Every torch call of a long-lived owner (a Ray actor, the HTTP app) on one thread of its own.

libgomp keeps one team of OpenMP threads per thread that starts a parallel region, and once a process holds more
OpenMP threads than CPUs it cuts how long an idle team thread spins before it sleeps (GOMP_SPINCOUNT 300,000 ->
30,000): every parallel region then waits on a futex. An actor that loads its model in `__init__` (Ray's main
thread) and runs its methods on Ray's executor threads holds two teams or more; on 2 cores that made S2 pooling
1.4-1.7x slower than the same code on one thread (bench/README.md, "One thread for torch"). One thread also
means a queue: calls of one batch function waiting in it are merged into one run (`submit_batch`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
R = TypeVar("R")
A = TypeVar("A")


@dataclass
class _Merged(Generic[R, A]):
    """The `submit_batch` calls that one run of the batch function answers together: each caller's items and
    future."""

    parts: list[tuple[Sequence[R], Future[list[A]]]] = field(default_factory=list)
    size: int = 0  # items over all parts


class ComputeThread:
    """A single worker thread: `call` runs a function there and returns its result (or raises its error);
    a call made from that thread itself runs in place, so wrapped methods may call each other."""

    def __init__(self, name: str = "torch") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident = self._executor.submit(threading.get_ident).result()
        self._waiting: dict[Callable[..., Any], _Merged[Any, Any]] = {}
        self._lock = threading.Lock()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """`fn(*args, **kwargs)` queued on the thread (an asyncio caller awaits `asyncio.wrap_future` of it)."""
        return self._executor.submit(fn, *args, **kwargs)

    def submit_batch(self, many: Callable[[list[R]], Sequence[A]], items: Sequence[R], *,
                     max_items: int) -> Future[list[A]]:
        """`many(items)`'s answers, run together with the items of every other call for the same `many` that is
        still waiting for the thread (up to `max_items` in one run): under load the batch is whatever piled up
        behind the running call, and nothing waits to fill one when the thread is free."""
        part: Future[list[A]] = Future()
        with self._lock:
            merged = self._waiting.get(many)
            if merged is None or merged.size + len(items) > max_items:
                merged = _Merged()
                self._waiting[many] = merged
                self._executor.submit(self._run_merged, many, merged)
            merged.parts.append((items, part))
            merged.size += len(items)
        return part

    def _run_merged(self, many: Callable[[list[R]], Sequence[A]], merged: _Merged[R, A]) -> None:
        with self._lock:
            if self._waiting.get(many) is merged:
                del self._waiting[many]
        # A caller that gave up (an asyncio task cancelled, its future with it) is left out of the run.
        parts = [(items, future) for items, future in merged.parts if future.set_running_or_notify_cancel()]
        if not parts:
            return
        items = [item for part, _ in parts for item in part]
        try:
            answers = list(many(items))
            if len(answers) != len(items):
                raise RuntimeError(f"{getattr(many, '__name__', many)}: {len(answers)} answers for {len(items)} items")
        except BaseException as exc:  # every caller of the run gets its error
            for _, future in parts:
                future.set_exception(exc)
            return
        start = 0
        for part, future in parts:
            future.set_result(answers[start:start + len(part)])
            start += len(part)

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        if self.on_thread():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident


def on_compute_thread(method: Callable[..., T]) -> Callable[..., T]:
    """A method of an object with a `compute: ComputeThread` attribute, run on that thread."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> T:
        return self.compute.call(method, self, *args, **kwargs)

    return run


def with_compute_thread(cls: type[T], methods: tuple[str, ...]) -> type[T]:
    """`cls` whose `__init__` and `methods` run on one ComputeThread: the class to hand `ray.remote`. Other
    methods (progress, pid) stay on Ray's threads, so they answer while a long call runs."""
    base: Any = cls

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.compute = ComputeThread(cls.__name__)
        self.compute.call(base.__init__, self, *args, **kwargs)

    namespace: dict[str, Any] = {"__init__": __init__, "__module__": cls.__module__, "__doc__": cls.__doc__,
                                 "__qualname__": cls.__qualname__}
    namespace.update({name: on_compute_thread(getattr(cls, name)) for name in methods})
    return type(cls.__name__, (cls,), namespace)  # type: ignore[return-value]
