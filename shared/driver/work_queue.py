"""One Ray work queue for every driver stage: a job per idle actor (or a plain task), results as they complete.

ray.util.ActorPool cannot wait on actor calls and plain tasks together (a pooled concept's D1 probe is a
task), never kills its actors and gives up when one dies; this queue does all three: a job whose worker or node
was lost goes back to the queue (a bounded number of times) and runs on a surviving or replacement actor.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import (
    ActorUnavailableError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    RayTaskError,
    WorkerCrashedError,
)

from poolbench.errors import PoolBenchError, without_colours
from poolbench.records.events import JobRetried

from .nodes import alive_nodes, cluster_nodes, locate, recorded_node_id

K = TypeVar("K")


class WorkQueueError(PoolBenchError):
    """A job failed with an error that is not PoolBench's own (or its worker died for good): one line naming it."""


class WorkerLost(WorkQueueError):
    """A job's worker process or node went away under it: the job itself may well succeed elsewhere."""


LOST_TASK_ERRORS = (WorkerCrashedError, NodeDiedError, ObjectLostError, LocalRayletDiedError)
MAX_ATTEMPTS = 3
"""A job runs at most this often: a node lost under it twice is bad luck, three times a job that kills workers."""
LOCATE_WAIT_S = 5.0
"""How long a lost actor's location may take to arrive (only on the loss path: a live queue never waits on it)."""


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


_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b.*?: .+")


def _first_line(error: BaseException) -> str:
    lines = without_colours(str(error)).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def worker_death_cause(error: BaseException) -> str:
    """The worker's own exception line ("OSError: config.json: ...") from a Ray actor-death message, which carries
    the remote traceback as text with colour codes; its first line when there is none."""
    lines = [line.strip() for line in without_colours(str(error)).splitlines() if line.strip()]
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
        raise WorkerLost(f"{what} failed: its worker died ({_first_line(exc)})") from exc
    except LOST_TASK_ERRORS as exc:
        raise WorkerLost(f"{what} failed: its worker died ({_first_line(exc)})") from exc


class WorkQueue(Generic[K]):
    """Owns a pool of Ray actors for one stage; leaving the `with` block kills them, however the run stops.

    `spawn()` starts a replacement actor when every actor is lost (none is started while one survives: on a CPU
    cluster a second actor on the surviving node would take the cores the probe tasks wait for); `needs` is one
    actor's resource request, so the queue can tell that no alive node could hold a replacement and stop;
    `own_actors=False` leaves the actors alive (replacements included) when the queue closes, for an owner that
    hands them to the next queue (the extractors of a run over several models). `slots`: jobs an actor holds at
    once (its max_concurrency must allow them): a second one is sent only while at least as many jobs wait as
    there are actors, so no actor idles at the end while another still holds a job it took early."""

    def __init__(self, actors: Sequence[ActorHandle] = (), *, spawn: Callable[[], ActorHandle] | None = None,
                 needs: Mapping[str, float] | None = None, on_retry: Callable[[JobRetried], None] | None = None,
                 label: Callable[[K], str] = str, max_attempts: int = MAX_ATTEMPTS,
                 task_needs: Mapping[str, float] | None = None, own_actors: bool = True, slots: int = 1) -> None:
        self.actors = list(actors)
        self.slots = max(1, slots)
        self.own_actors = own_actors
        self.spawn, self.needs, self.label, self.max_attempts = spawn, dict(needs or {}), label, max_attempts
        self.task_needs = dict(task_needs or {})  # one task's resources: tasks no alive node can run stop the run
        self.on_retry = on_retry or (lambda _: None)
        self.retried: list[JobRetried] = []
        self.lost_nodes: list[str] = []
        self.done_on: Counter[str] = Counter()  # actor jobs finished per node
        self.last_done_on = ""  # the node of the actor whose job the queue yielded last ("" for a task)
        self._owned = list(actors)
        self._where = {id(actor): locate(actor) for actor in actors}
        self._names: dict[str, str] = {}
        self._planned = len(self.actors)
        self._suspects: set[str] = set()
        self._running: dict[ray.ObjectRef, tuple[Job[K] | None, ActorHandle | None]] = {}

    def __enter__(self) -> WorkQueue[K]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel tasks still running and kill every actor it owns: nothing keeps a model, GPU or CPU after the
        run (lost actors were killed when they were lost)."""
        for ref, (job, actor) in self._running.items():
            if actor is None and job is not None:
                with contextlib.suppress(Exception):  # a task that just finished cannot be cancelled
                    ray.cancel(ref, force=True)  # only force stops a task inside C code (a solver, a sleep)
        self._running.clear()
        for actor in self._owned if self.own_actors else ():
            with contextlib.suppress(Exception):  # an actor that already died is fine
                ray.kill(actor, no_restart=True)

    def node_of(self, actor: ActorHandle, wait: float = 0.0) -> str:
        """The `ip:port` of the node the actor started on, "" while it is still starting (or never did). `wait`:
        seconds to let its location's reply arrive (a lost actor that ran jobs started; its reply may still be on
        the way when its death is seen first, and the retry must name the node)."""
        ref = self._where.get(id(actor))
        if ref is None:
            return ""
        try:
            node_id = ray.get(ref, timeout=wait)
        except (ray.exceptions.RayError, TimeoutError):  # still starting, never started, or died before replying
            node_id = recorded_node_id(actor) if wait else ""
            if not node_id:
                return ""
        if node_id not in self._names:
            self._names.update({n.node_id: n.name for n in cluster_nodes()})
        return self._names.get(node_id, node_id[:12])

    def nodes(self) -> list[str]:
        """Every actor's node (`ip:port`), waiting for the actors to start; a worker that cannot start raises."""
        for actor in self.actors:
            fetch(self._where[id(actor)], "a worker's start")
        return [self.node_of(actor) for actor in self.actors]

    def run(self, jobs: Iterable[Job[K]], follow_up: FollowUp[K] | None = None, *,
            on_wait: Callable[[], None] | None = None, wait_s: float = 1.0) -> Iterator[tuple[K, Any]]:
        """Yield (key, result) per job as it completes; actor jobs wait in order for an idle actor.

        After the caller has taken a result, `follow_up(key, result)` may add jobs (a pooled concept's D1 task).
        `on_wait()` runs every `wait_s` seconds in which nothing completes (progress polling).
        A job whose worker or node was lost runs again (up to max_attempts in all, each retry reported to
        `on_retry`); any other error stops the run: the worker's PoolBenchError, or a one-line WorkQueueError.
        """
        waiting: deque[ActorJob[K]] = deque()
        idle = deque(actor for _ in range(self.slots) for actor in self.actors)  # an entry per free slot
        running = self._running
        starting: dict[ray.ObjectRef, ActorHandle] = {}  # replacement actors, until their model is loaded
        attempts: dict[int, int] = {}
        lost_at: dict[int, tuple[str, str, str]] = {}  # a requeued job -> (node it was lost on, how, cause)

        def submit(job: Job[K]) -> None:
            if isinstance(job, TaskJob):
                running[job.start()] = (job, None)
            elif not self.actors:
                raise WorkQueueError(f"{job.key} needs an actor and the queue has none")
            else:
                waiting.append(job)

        def start(job: Job[K], actor: ActorHandle | None) -> None:
            if id(job) in lost_at:
                node, how, cause = lost_at.pop(id(job))
                if node and node in self._dead_nodes():
                    how = "lost"
                event = JobRetried(self.label(job.key), attempts[id(job)], cause, node, how,
                                   self.node_of(actor) if actor is not None else "")
                self.retried.append(event)
                self.on_retry(event)
            if isinstance(job, TaskJob):
                running[job.start()] = (job, None)
            else:
                assert actor is not None
                running[job.call(actor)] = (job, actor)

        def dispatch() -> None:
            while waiting and idle:
                actor = next((a for a in idle if idle.count(a) == self.slots), None)  # one with no job in flight
                if actor is None:  # only second slots are free: used while every actor will get a job anyway
                    if len(waiting) < len(self.actors):
                        return
                    actor = idle[0]
                idle.remove(actor)
                start(waiting.popleft(), actor)

        def lose(actor: ActorHandle) -> None:
            """Drop a lost actor (and every idle one on a node that is gone too); replace them if none is left."""
            dead = self._dead_nodes()
            for other in [actor, *[a for a in idle if self.node_of(a) in dead]]:
                if other in self.actors:
                    self.actors.remove(other)
                while other in idle:
                    idle.remove(other)
                with contextlib.suppress(Exception):
                    ray.kill(other, no_restart=True)
            if not self.actors:
                new = self._replace()
                starting[self._where[id(new)]] = new
                running[self._where[id(new)]] = (None, new)

        def requeue(job: Job[K], actor: ActorHandle | None, lost: WorkerLost) -> None:
            attempts[id(job)] = attempts.get(id(job), 1) + 1
            if attempts[id(job)] > self.max_attempts:
                raise WorkQueueError(f"{lost} (its workers were lost {self.max_attempts} times: giving up)") from lost
            node = self.node_of(actor, wait=LOCATE_WAIT_S) if actor is not None else ""
            if node:
                self._suspects.add(node)
            how = "unreachable" if isinstance(lost.__cause__, ActorUnavailableError) else "died"
            lost_at[id(job)] = (node, how, str(lost))
            if actor is not None:
                lose(actor)
            if isinstance(job, TaskJob):
                start(job, None)
            else:
                waiting.appendleft(job)

        for job in jobs:
            submit(job)
        dispatch()
        while waiting or any(job is not None for job, _ in running.values()):
            timed = on_wait is not None or starting  # replacements are watched for a cluster with no room left
            ready, _ = ray.wait(list(running), num_returns=1, timeout=wait_s if timed else None)
            if not ready:
                if on_wait is not None:
                    on_wait()
                if waiting and len(starting) == len(self.actors):  # only replacements that may never start
                    self._check_room(self.needs)
                elif self.task_needs and any(a is None and j is not None for j, a in running.values()):
                    self._check_room(self.task_needs)
                continue
            ref = ready[0]
            job, actor = running.pop(ref)
            if job is None:  # a replacement actor is up, or could not start
                assert actor is not None
                starting.pop(ref, None)
                try:
                    fetch(ref, "a replacement worker")
                except WorkerLost:
                    lose(actor)
                    continue
                idle.extend([actor] * self.slots)
                dispatch()
                continue
            try:
                result = fetch(ref, job.key)
            except WorkerLost as lost:
                requeue(job, actor, lost)
                dispatch()
                continue
            self.last_done_on = ""
            if actor is not None:
                idle.append(actor)
                self.last_done_on = self.node_of(actor) or "unknown"
                self.done_on[self.last_done_on] += 1
            dispatch()
            yield job.key, result
            for extra in follow_up(job.key, result) if follow_up else ():
                submit(extra)
            dispatch()
        self._confirm_lost()

    def _dead_nodes(self) -> set[str]:
        return {n.name for n in cluster_nodes() if not n.alive}

    def _confirm_lost(self) -> None:
        """Nodes a job was lost on that the GCS has declared dead since: the run's record of lost nodes."""
        if self._suspects:
            dead = self._dead_nodes()
            self.lost_nodes.extend(sorted(n for n in self._suspects & dead if n not in self.lost_nodes))

    def _replace(self) -> ActorHandle:
        """Start one replacement actor on whichever alive node holds it; stop in one line when none can."""
        self._check_room(self.needs)
        if self.spawn is None:
            raise WorkQueueError("every worker of this stage was lost and none can be started in its place")
        if len(self._owned) >= self._planned + 2 * self.max_attempts:
            raise WorkQueueError(f"{len(self._owned)} workers of this stage started and were lost: giving up")
        actor = self.spawn()
        self._owned.append(actor)
        self.actors.append(actor)
        self._where[id(actor)] = locate(actor)
        return actor

    def _check_room(self, needs: Mapping[str, float]) -> None:
        """One line when no alive node could hold one actor (or task) of this stage: the run cannot go on, only
        resume."""
        if needs and not any(node.fits(needs) for node in alive_nodes()):
            self._confirm_lost()
            wanted = ", ".join(f"{v:g} {k}" for k, v in needs.items())
            lost = f" (lost: {', '.join(self.lost_nodes)})" if self.lost_nodes else ""
            raise WorkQueueError(f"no node with {wanted} is left in the Ray cluster{lost}: finished artifacts are "
                                 "kept in the store; run the same command again once nodes are back to resume")


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
