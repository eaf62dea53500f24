"""The driver's one work queue on a real local Ray: a job per idle actor, follow-ups, one-line errors, no leaks."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import pytest
import ray
import ray.cloudpickle
from ray.exceptions import RayActorError, TaskCancelledError

from poolbench.driver.nodes import locate
from poolbench.driver.work_queue import ActorJob, TaskJob, WorkQueue, WorkQueueError
from poolbench.errors import CorpusError
from poolbench.records.events import JobRetried


class Sleeper:
    """A tiny actor: names itself, holds a job until its gate file appears, and fails on request."""

    def __init__(self, name: str) -> None:
        self.name = name

    def work(self, job: str, gate: str | None = None) -> tuple[str, str]:
        if gate is not None:
            wait_for_file(gate)
        return job, self.name

    def fail(self, job: str) -> None:
        raise CorpusError(f"concept {job}: train_pos.jsonl:3 is not JSON")

    def ping(self) -> str:
        return self.name

    def die_once(self, job: str, marker: str) -> tuple[str, str]:
        """The first call anywhere (no marker yet) kills its own process mid-job; later calls do the job."""
        if not os.path.exists(marker):
            Path(marker).touch()
            os._exit(1)
        return job, self.name

    def die(self, job: str) -> None:
        os._exit(1)


# Ray workers cannot import this test module: ship its tiny actors and tasks by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def wait_for_file(path: str, within: float = 120.0) -> None:
    """Block until `path` exists: the test opens the gate when the event it orders against has happened."""
    deadline = time.monotonic() + within
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} never opened in {within} s")
        time.sleep(0.02)


def double(value: int) -> int:
    return 2 * value


def broken(value: int) -> int:
    raise ValueError(f"cannot take {value}\nsecond line of detail")


def die_once_task(value: int, marker: str) -> int:
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)
    return 2 * value


def sleeping(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def actors(*names: str) -> list:
    cls = ray.remote(num_cpus=0)(Sleeper)
    return [cls.remote(name) for name in names]


def work(job: str, gate: Path | None = None) -> ActorJob[str]:
    return ActorJob(job, lambda actor: actor.work.remote(job, None if gate is None else str(gate)))


def assert_dead(handles: list, within: float = 30.0) -> None:
    """ray.kill is asynchronous: a call sent just after it may still be served, but none after a few seconds."""
    deadline = time.monotonic() + within
    for actor in handles:
        with pytest.raises(RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.ping.remote(), timeout=within)
                time.sleep(0.1)


def test_one_job_per_idle_actor_in_completion_order(local_ray, tmp_path):
    # j0 holds a until j3 has come back; b takes j1, then j2, then j3 as it frees up, so they finish first.
    # A queue that handed jobs out round-robin up front would put j2 behind j0 on a, and never finish.
    handles = actors("a", "b")
    assert ray.get([h.ping.remote() for h in handles]) == ["a", "b"]
    gate = tmp_path / "j3-done"
    done = []
    with WorkQueue(handles) as queue:
        for key, result in queue.run([work("j0", gate), work("j1"), work("j2"), work("j3")]):
            done.append((key, result))
            if key == "j3":
                gate.touch()
    assert done == [("j1", ("j1", "b")), ("j2", ("j2", "b")), ("j3", ("j3", "b")), ("j0", ("j0", "a"))]
    assert_dead(handles)


def test_a_single_actor_runs_jobs_in_submission_order(local_ray):
    handles = actors("only")
    with WorkQueue(handles) as queue:
        keys = [key for key, _ in queue.run([work(f"j{i}") for i in range(5)])]
    assert keys == ["j0", "j1", "j2", "j3", "j4"]


def concurrent_actors(*names: str, concurrency: int = 2) -> list:
    cls = ray.remote(num_cpus=0, max_concurrency=concurrency)(Sleeper)
    return [cls.remote(name) for name in names]


def test_an_actor_with_two_slots_holds_a_second_job_while_the_first_runs(local_ray, tmp_path):
    """One actor, two slots (a GPU extractor's queue): j1 is sent while j0 still runs and finishes first; the rest
    follow in order as slots free up. One slot (the default) would wait for j0 and never open its gate."""
    [actor] = concurrent_actors("only")
    gate = tmp_path / "j1-done"
    done = []
    with WorkQueue([actor], slots=2) as queue:
        for key, _ in queue.run([work("j0", gate), work("j1"), work("j2"), work("j3")]):
            done.append(key)
            if key == "j1":
                gate.touch()
    assert done[0] == "j1" and sorted(done) == ["j0", "j1", "j2", "j3"]


def test_a_second_slot_is_not_taken_while_another_actor_may_go_idle(local_ray, tmp_path):
    """Two actors, two slots each, three jobs: j0 and j1 take each actor's first slot; j2 waits for a free actor
    rather than take a second slot (only one job waits, fewer than the actors), so it runs on b, which finished j1,
    while a still holds j0. Taking a's second slot early would leave j2 behind j0 and b idle."""
    handles = concurrent_actors("a", "b")
    assert ray.get([h.ping.remote() for h in handles]) == ["a", "b"]
    gate = tmp_path / "j2-done"
    done = []
    with WorkQueue(handles, slots=2) as queue:
        for key, result in queue.run([work("j0", gate), work("j1"), work("j2")]):
            done.append((key, result[1]))
            if key == "j2":
                gate.touch()
    assert done == [("j1", "b"), ("j2", "b"), ("j0", "a")]


def test_both_jobs_of_a_lost_two_slot_actor_run_again_on_one_replacement(local_ray, tmp_path):
    """The actor dies holding two jobs: each comes back once, one replacement is started (not one a job), with
    two slots of its own."""
    [first] = concurrent_actors("first")
    marker = str(tmp_path / "died")
    gate = tmp_path / "gate"
    spawned: list = []

    def spawn():
        spawned.append(concurrent_actors("replacement")[0])
        gate.touch()
        return spawned[-1]

    jobs = [work("j0", gate), ActorJob("j1", lambda actor: actor.die_once.remote("j1", marker)), work("j2")]
    retried: list[JobRetried] = []
    with WorkQueue([first], spawn=spawn, needs={"CPU": 0.5}, slots=2, on_retry=retried.append) as queue:
        done = dict(queue.run(jobs))
    assert done == {"j0": ("j0", "replacement"), "j1": ("j1", "replacement"), "j2": ("j2", "replacement")}
    assert len(spawned) == 1 and sorted(r.job for r in retried) == ["j0", "j1"]


def test_follow_ups_run_as_tasks_after_their_job(local_ray):
    task = ray.remote(num_cpus=0)(double)
    jobs: list = [ActorJob(("pool", n), lambda actor, n=n: actor.work.remote(n)) for n in (3, 5)]
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


def test_an_interrupted_run_kills_its_actors_and_cancels_its_tasks(local_ray, tmp_path):
    handles = actors("a", "b")
    slow = ray.remote(num_cpus=0)(sleeping)
    refs: list = []

    def start_slow():
        refs.append(slow.remote(60.0))
        return refs[-1]

    jobs = [work("quick"), work("long", tmp_path / "never"), TaskJob("slow", start_slow)]
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


def test_on_wait_runs_while_nothing_completes_and_never_without_a_wait(local_ray, tmp_path, monkeypatch):
    """Progress polling: each on_wait follows a ray.wait of wait_s that returned nothing; the held job is let go
    on the third call. Without on_wait the queue blocks in ray.wait (no timeout) as before."""
    handles = actors("a")
    assert ray.get(handles[0].ping.remote()) == "a"
    gate = tmp_path / "go"
    events: list[tuple] = []
    real_wait = ray.wait

    def spy_wait(refs, **kwargs):
        ready, rest = real_wait(refs, **kwargs)
        events.append(("wait", kwargs.get("timeout"), len(ready)))
        return ready, rest

    def on_wait():
        events.append(("on_wait",))
        if sum(e[0] == "on_wait" for e in events) == 3:
            gate.touch()

    monkeypatch.setattr(ray, "wait", spy_wait)
    with WorkQueue(handles) as queue:
        done = list(queue.run([work("slow", gate)], on_wait=on_wait, wait_s=0.2))
        assert done == [("slow", ("slow", "a"))]
        assert sum(e[0] == "on_wait" for e in events) >= 3
        for before, event in itertools.pairwise(events):
            if event[0] == "on_wait":
                assert before == ("wait", 0.2, 0)  # only after a full wait in which nothing completed
        assert events[-1] == ("wait", 0.2, 1)
        events.clear()
        assert list(queue.run([work("plain")])) == [("plain", ("plain", "a"))]
        assert events == [("wait", None, 1)]


def test_a_job_whose_worker_died_runs_again_on_a_surviving_actor(local_ray, tmp_path):
    """`a` dies inside j0 (its process exits): j0 goes back to the queue and runs on `b`, reported once; Ray starts
    nothing in `a`'s place (max_restarts=0) and neither does the queue, since `b` survives."""
    handles = actors("a", "b")
    assert ray.get([h.ping.remote() for h in handles]) == ["a", "b"]
    marker = str(tmp_path / "died")
    retried: list[JobRetried] = []
    jobs = [ActorJob("j0", lambda actor: actor.die_once.remote("j0", marker)), work("j1", tmp_path / "j1-gate")]
    (tmp_path / "j1-gate").touch()
    with WorkQueue(handles, on_retry=retried.append) as queue:
        done = dict(queue.run(jobs))
        assert len(queue.actors) == 1
    assert done == {"j0": ("j0", "b"), "j1": ("j1", "b")}
    [retry] = retried
    assert (retry.job, retry.attempt, retry.how) == ("j0", 2, "died")
    [node] = ray.nodes()
    assert retry.node == retry.on == f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"  # the one node
    assert "j0 failed: its worker died" in retry.cause


def test_a_worker_that_died_before_its_location_reply_is_named_by_the_gcs(local_ray):
    """The race CI hit: the worker exits before the reply of its `locate` call leaves it, so that ref fails with the
    actor's death; the retry must still name the node, which the GCS's actor table keeps for a dead actor. Built
    here by asking a dead actor where it is; without a wait (a worker still starting) the answer stays ""."""
    [actor] = actors("a")
    assert ray.get(actor.ping.remote()) == "a"
    ray.kill(actor, no_restart=True)
    assert_dead([actor])
    with WorkQueue([actor]) as queue:
        queue._where[id(actor)] = locate(actor)  # a location asked of a dead worker: it fails, as the raced reply did
        with pytest.raises(RayActorError):
            ray.get(queue._where[id(actor)], timeout=30)
        [node] = ray.nodes()
        assert queue.node_of(actor, wait=5.0) == f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
        assert queue.node_of(actor) == ""


def test_when_every_actor_is_lost_a_replacement_takes_the_job(local_ray, tmp_path):
    handles = actors("first")
    marker = str(tmp_path / "died")
    spawn = lambda: actors("replacement")[0]  # noqa: E731
    with WorkQueue(handles, spawn=spawn, needs={"CPU": 0.5}) as queue:
        done = list(queue.run([ActorJob("j0", lambda actor: actor.die_once.remote("j0", marker)), work("j1")]))
    assert done == [("j0", ("j0", "replacement")), ("j1", ("j1", "replacement"))]


def test_a_job_that_kills_every_worker_stops_after_max_attempts_in_one_line(local_ray):
    spawned: list = []

    def spawn():
        spawned.extend(actors(f"r{len(spawned)}"))
        return spawned[-1]

    with pytest.raises(WorkQueueError) as raised, WorkQueue(actors("a"), spawn=spawn, max_attempts=3) as queue:
        list(queue.run([ActorJob("poison", lambda actor: actor.die.remote("poison"))]))
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("poison failed: its worker died") and "lost 3 times: giving up" in message
    assert len(spawned) == 2  # attempts 2 and 3 ran on replacements; no fourth was started


def test_no_node_left_that_holds_a_replacement_is_one_line(local_ray, tmp_path):
    """The stage's actors need a GPU; the only node has none once its one actor is lost: the run stops, saying so,
    instead of waiting forever for a replacement Ray cannot place."""
    marker = str(tmp_path / "died")
    with pytest.raises(WorkQueueError) as raised, WorkQueue(actors("a"), spawn=lambda: actors("never")[0],
                                                            needs={"GPU": 1, "CPU": 1}) as queue:
        list(queue.run([ActorJob("pool code_docs", lambda actor: actor.die_once.remote("x", marker))]))
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("no node with 1 GPU, 1 CPU is left in the Ray cluster") and "resume" in message


def test_a_task_whose_worker_died_is_submitted_again(local_ray, tmp_path):
    task = ray.remote(num_cpus=0, max_retries=0)(die_once_task)
    marker = str(tmp_path / "died")
    retried: list[JobRetried] = []
    with WorkQueue(on_retry=retried.append) as queue:
        assert list(queue.run([TaskJob("probe x", lambda: task.remote(21, marker))])) == [("probe x", 42)]
    assert [(r.job, r.attempt, r.on) for r in retried] == [("probe x", 2, "")]


def test_tasks_no_alive_node_can_run_stop_the_run_in_one_line(local_ray):
    """A probe task waits for a resource no node has (a GPU here, a CPU once every CPU node is lost): one line,
    not a wait without end."""
    task = ray.remote(num_gpus=1)(double)
    with pytest.raises(WorkQueueError) as raised, WorkQueue(task_needs={"GPU": 1}) as queue:
        list(queue.run([TaskJob("probe x", lambda: task.remote(1))], on_wait=lambda: None, wait_s=0.2))
    assert str(raised.value).startswith("no node with 1 GPU is left in the Ray cluster")
