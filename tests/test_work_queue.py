"""The driver's one work queue on a real local Ray: a job per idle actor, follow-ups, one-line errors, no leaks."""

from __future__ import annotations

import itertools
import sys
import time

import pytest
import ray
import ray.cloudpickle
from ray.exceptions import RayActorError, TaskCancelledError

from poolbench.driver.work_queue import ActorJob, TaskJob, WorkQueue, WorkQueueError
from poolbench.errors import CorpusError


class Sleeper:
    """A tiny actor: names itself, sleeps as told, and fails on request."""

    def __init__(self, name: str) -> None:
        self.name = name

    def work(self, job: str, seconds: float) -> tuple[str, str]:
        time.sleep(seconds)
        return job, self.name

    def fail(self, job: str) -> None:
        raise CorpusError(f"concept {job}: train_pos.jsonl:3 is not JSON")

    def ping(self) -> str:
        return self.name


# Ray workers cannot import this test module: ship its tiny actors and tasks by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def double(value: int) -> int:
    return 2 * value


def broken(value: int) -> int:
    raise ValueError(f"cannot take {value}\nsecond line of detail")


def sleeping(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def actors(*names: str) -> list:
    cls = ray.remote(num_cpus=0)(Sleeper)
    return [cls.remote(name) for name in names]


def work(job: str, seconds: float = 0.0) -> ActorJob[str]:
    return ActorJob(job, lambda actor: actor.work.remote(job, seconds))


def assert_dead(handles: list, within: float = 30.0) -> None:
    """ray.kill is asynchronous: a call sent just after it may still be served, but none after a few seconds."""
    deadline = time.monotonic() + within
    for actor in handles:
        with pytest.raises(RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.ping.remote(), timeout=within)
                time.sleep(0.1)


def test_one_job_per_idle_actor_in_completion_order(local_ray):
    # j0 holds a for 3 s; b takes j1, then j2, then j3 as it frees up, so they finish first.
    # A queue that handed jobs out round-robin up front would put j2 behind j0 on a.
    handles = actors("a", "b")
    assert ray.get([h.ping.remote() for h in handles]) == ["a", "b"]  # both started: timing is the jobs' alone
    with WorkQueue(handles) as queue:
        done = list(queue.run([work("j0", 3.0), work("j1"), work("j2"), work("j3")]))
    assert done == [("j1", ("j1", "b")), ("j2", ("j2", "b")), ("j3", ("j3", "b")), ("j0", ("j0", "a"))]
    assert_dead(handles)


def test_a_single_actor_runs_jobs_in_submission_order(local_ray):
    handles = actors("only")
    with WorkQueue(handles) as queue:
        keys = [key for key, _ in queue.run([work(f"j{i}") for i in range(5)])]
    assert keys == ["j0", "j1", "j2", "j3", "j4"]


def test_follow_ups_run_as_tasks_after_their_job(local_ray):
    task = ray.remote(num_cpus=0)(double)
    jobs: list = [ActorJob(("pool", n), lambda actor, n=n: actor.work.remote(n, 0.0)) for n in (3, 5)]
    jobs.append(TaskJob(("probe", 7), lambda: task.remote(7)))  # a concept pooled earlier: straight to D1

    def follow_up(key, result):
        if key[0] == "pool":
            value, _ = result
            return [TaskJob(("probe", value), lambda: task.remote(value))]
        return []

    with WorkQueue(actors("a")) as queue:
        done = list(queue.run(jobs, follow_up))
    results = dict(done)
    assert results[("probe", 3)] == 6 and results[("probe", 5)] == 10 and results[("probe", 7)] == 14
    assert results[("pool", 3)] == (3, "a") and results[("pool", 5)] == (5, "a")
    order = [key for key, _ in done]
    assert len(order) == 5
    assert order.index(("pool", 3)) < order.index(("probe", 3))
    assert order.index(("pool", 5)) < order.index(("probe", 5))


def test_a_poolbench_error_in_an_actor_arrives_as_itself_in_one_line(local_ray):
    handles = actors("a")
    with pytest.raises(CorpusError) as raised, WorkQueue(handles) as queue:
        list(queue.run([ActorJob("hedging", lambda actor: actor.fail.remote("hedging"))]))
    assert str(raised.value) == "concept hedging: train_pos.jsonl:3 is not JSON"
    assert_dead(handles)


def test_any_other_task_error_is_one_line_naming_the_job(local_ray):
    handles = actors("a")
    task = ray.remote(num_cpus=0, max_retries=0)(broken)
    with pytest.raises(WorkQueueError) as raised, WorkQueue(handles) as queue:
        list(queue.run([TaskJob("probe toxicity", lambda: task.remote(4))]))
    assert str(raised.value) == "probe toxicity failed: ValueError: cannot take 4"
    assert_dead(handles)


def test_an_interrupted_run_kills_its_actors_and_cancels_its_tasks(local_ray):
    handles = actors("a", "b")
    slow = ray.remote(num_cpus=0)(sleeping)
    refs: list = []

    def start_slow():
        refs.append(slow.remote(60.0))
        return refs[-1]

    jobs = [work("quick"), work("long", 60.0), TaskJob("slow", start_slow)]
    with pytest.raises(KeyboardInterrupt), WorkQueue(handles) as queue:
        for key, _ in queue.run(jobs):
            assert key == "quick"
            raise KeyboardInterrupt  # as Ctrl-C in the driver would, while other work is still running
    assert_dead(handles)
    with pytest.raises(TaskCancelledError):
        ray.get(refs[0], timeout=30)


def test_actor_jobs_without_actors_are_refused(local_ray):
    with pytest.raises(WorkQueueError, match="j0 needs an actor"), WorkQueue() as queue:
        list(queue.run([work("j0")]))


def test_on_wait_runs_while_nothing_completes_and_never_without_a_wait(local_ray):
    """Progress polling: a 1.5 s job with wait_s 0.2 leaves several empty waits, each a full wait_s apart;
    without on_wait the queue blocks as before."""
    handles = actors("a")
    assert ray.get(handles[0].ping.remote()) == "a"
    calls: list[float] = []
    with WorkQueue(handles) as queue:
        done = list(queue.run([work("slow", 1.5)], on_wait=lambda: calls.append(time.monotonic()), wait_s=0.2))
        assert done == [("slow", ("slow", "a"))]
        assert len(calls) >= 2  # at most ~7 windows of 0.2 s in 1.5 s, fewer on a busy machine
        assert min(b - a for a, b in itertools.pairwise(calls)) >= 0.19  # each call follows a full empty wait
        assert list(queue.run([work("plain")])) == [("plain", ("plain", "a"))]
