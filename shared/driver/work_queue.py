"""One Ray work queue for every driver stage: a job per idle actor (or a plain task), results as they complete.

ray.util.ActorPool cannot wait on actor calls and plain tasks together (a pooled concept's D1 probe is a
task) and never kills its actors; this queue does both, so no stage carries its own scheduling loop.
"""

from __future__ import annotations

import contextlib
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from poolbench.errors import PoolBenchError

K = TypeVar("K")


class WorkQueueError(PoolBenchError):
    """A job failed with an error that is not PoolBench's own (or its worker died for good): one line naming it."""


@dataclass(frozen=True)
class ActorJob(Generic[K]):
    """Work for whichever actor is idle next: `call(actor)` submits the actor method and returns its ref."""

    key: K
    call: Callable[[ActorHandle], ray.ObjectRef]


@dataclass(frozen=True)
class TaskJob(Generic[K]):
    """Work that needs no actor: `start()` submits a Ray task (holding its own resources) and returns its ref."""

    key: K
    start: Callable[[], ray.ObjectRef]


Job = ActorJob[K] | TaskJob[K]
FollowUp = Callable[[K, Any], Iterable[Job[K]]]


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b.*?: .+")


def _first_line(error: BaseException) -> str:
    lines = ANSI.sub("", str(error)).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def worker_death_cause(error: BaseException) -> str:
    """The worker's own exception line ("OSError: config.json: ...") from a Ray actor-death message, which carries
    the remote traceback as text with colour codes; its first line when there is none."""
    lines = [line.strip() for line in ANSI.sub("", str(error)).splitlines() if line.strip()]
    raised = [line for line in lines if _RAISED.match(line)]
    if raised:
        return raised[-1]
    return lines[0] if lines else type(error).__name__


def fetch(ref: ray.ObjectRef, what: object) -> Any:
    """ray.get, with a worker's error raised as itself (PoolBench errors) or as one line naming `what`."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, PoolBenchError):
            raise cause from exc
        detail = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else _first_line(exc)
        raise WorkQueueError(f"{what} failed: {detail}") from exc
    except RayActorError as exc:
        if "creation task" in str(exc):
            raise WorkQueueError(f"{what} failed: its worker could not start: {worker_death_cause(exc)}") from exc
        raise WorkQueueError(f"{what} failed: its worker died ({_first_line(exc)})") from exc


class WorkQueue(Generic[K]):
    """Owns a pool of Ray actors for one stage; leaving the `with` block kills them, however the run stops."""

    def __init__(self, actors: Sequence[ActorHandle] = ()) -> None:
        self.actors = list(actors)
        self._running: dict[ray.ObjectRef, tuple[Job[K], ActorHandle | None]] = {}

    def __enter__(self) -> WorkQueue[K]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel tasks still running and kill every actor: nothing keeps a model, GPU or CPU after the run."""
        for ref, (_, actor) in self._running.items():
            if actor is None:
                with contextlib.suppress(Exception):  # a task that just finished cannot be cancelled
                    ray.cancel(ref, force=True)  # only force stops a task inside C code (a solver, a sleep)
        self._running.clear()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # an actor that already died is fine
                ray.kill(actor)

    def run(self, jobs: Iterable[Job[K]], follow_up: FollowUp[K] | None = None, *,
            on_wait: Callable[[], None] | None = None, wait_s: float = 1.0) -> Iterator[tuple[K, Any]]:
        """Yield (key, result) per job as it completes; actor jobs wait in order for an idle actor.

        After the caller has taken a result, `follow_up(key, result)` may add jobs (a pooled concept's D1 task).
        `on_wait()` runs every `wait_s` seconds in which nothing completes (progress polling).
        An error stops the run: raised as the worker's PoolBenchError, or a one-line WorkQueueError.
        """
        waiting: deque[ActorJob[K]] = deque()
        idle = deque(self.actors)
        running = self._running

        def submit(job: Job[K]) -> None:
            if isinstance(job, TaskJob):
                running[job.start()] = (job, None)
            elif not self.actors:
                raise WorkQueueError(f"{job.key} needs an actor and the queue has none")
            else:
                waiting.append(job)

        def dispatch() -> None:
            while waiting and idle:
                job, actor = waiting.popleft(), idle.popleft()
                running[job.call(actor)] = (job, actor)

        for job in jobs:
            submit(job)
        dispatch()
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=wait_s if on_wait is not None else None)
            if not ready:
                if on_wait is not None:
                    on_wait()
                continue
            ref = ready[0]
            job, actor = running.pop(ref)
            if actor is not None:
                idle.append(actor)
            result = fetch(ref, job.key)
            dispatch()
            yield job.key, result
            for extra in follow_up(job.key, result) if follow_up else ():
                submit(extra)
            dispatch()


def poll_actors(actors: Sequence[ActorHandle], timeout_s: float = 2.0) -> list[dict]:
    """Every actor's progress() answer that is not None; an actor that does not answer in time (restarting,
    dying) is skipped: progress is a display, never a reason to stop."""
    refs = [actor.progress.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    states = []
    for ref in ready:
        try:
            state = ray.get(ref)
        except ray.exceptions.RayError:
            continue
        if state is not None:
            states.append(state)
    return states
