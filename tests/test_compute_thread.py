"""One thread for an actor's torch calls: __init__ and the listed methods share it, the others do not wait on it."""

from __future__ import annotations

import sys
import threading

import pytest
import ray

from poolbench.compute_thread import ComputeThread, with_compute_thread


class Recorder:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.init_thread = threading.get_ident()
        self.release = threading.Event()

    def work(self) -> int:
        return threading.get_ident()

    def nested(self) -> tuple[int, int]:
        return threading.get_ident(), self.work()

    def blocked(self) -> int:
        self.release.wait(10)
        return threading.get_ident()

    def fail(self) -> None:
        raise ValueError(f"{self.tag}: no")

    def where(self) -> tuple[int, int]:
        self.release.set()
        return self.init_thread, threading.get_ident()


METHODS = ("work", "nested", "blocked", "fail")


def test_init_and_listed_methods_share_one_thread_that_is_not_the_callers() -> None:
    worker = with_compute_thread(Recorder, METHODS)("a")
    assert worker.work() == worker.init_thread != threading.get_ident()
    assert worker.nested() == (worker.init_thread, worker.init_thread)  # a call from the thread runs in place
    init_thread, here = worker.where()
    assert here == threading.get_ident() != init_thread
    with pytest.raises(ValueError, match="a: no"):
        worker.fail()
    assert isinstance(worker, Recorder) and type(worker).__name__ == "Recorder"


def test_compute_thread_call_and_submit() -> None:
    compute = ComputeThread("t")
    ident = compute.call(threading.get_ident)
    assert compute.submit(threading.get_ident).result() == ident != threading.get_ident()
    assert not compute.on_thread() and compute.call(compute.on_thread)


@pytest.mark.usefixtures("local_ray")
def test_a_ray_actor_runs_init_and_work_on_one_thread_and_answers_others_meanwhile() -> None:
    """Ray runs the methods of an actor with max_concurrency=2 on its own executor threads; the wrapped ones
    still land on the thread __init__ ran on, and an unwrapped one answers while a wrapped one is blocked."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    actor = ray.remote(max_concurrency=2)(with_compute_thread(Recorder, METHODS)).remote("r")
    blocked = actor.blocked.remote()
    init_thread, answered_on = ray.get(actor.where.remote(), timeout=30)
    assert ray.get(blocked, timeout=30) == init_thread != answered_on
    assert ray.get(actor.work.remote(), timeout=30) == init_thread
    with pytest.raises(ray.exceptions.RayTaskError, match="r: no"):
        ray.get(actor.fail.remote(), timeout=30)


class Batches:
    """A batch function that records each run's items and answers each item with its square."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        if -1 in items:
            raise ValueError("a bad item")
        self.runs.append(list(items))
        return [i * i for i in items]


def _blocked(compute: ComputeThread) -> threading.Event:
    """Occupy the thread until the returned event is set, so the calls made meanwhile wait in its queue."""
    release, running = threading.Event(), threading.Event()
    compute.submit(lambda: (running.set(), release.wait(10)))
    assert running.wait(10)
    return release


def test_batch_calls_waiting_for_the_thread_run_as_one_and_each_gets_its_own_answers() -> None:
    compute, squares, other = ComputeThread("b"), Batches(), Batches()
    release = _blocked(compute)
    parts = [compute.submit_batch(squares, items, max_items=6) for items in ([1, 2], [3], [4, 5])]
    apart = compute.submit_batch(other, [7], max_items=6)  # another function is never merged in
    late = compute.submit_batch(squares, [6, 8], max_items=6)  # would make 7 items: a run of its own
    release.set()
    assert [p.result(10) for p in parts] == [[1, 4], [9], [16, 25]]
    assert apart.result(10) == [49] and late.result(10) == [36, 64]
    assert squares.runs == [[1, 2, 3, 4, 5], [6, 8]] and other.runs == [[7]]
    assert compute.submit_batch(squares, [9], max_items=6).result(10) == [81]  # a free thread runs it at once
    assert squares.runs[-1] == [9]


def test_an_error_in_a_merged_run_reaches_every_caller_of_that_run_only() -> None:
    compute, squares = ComputeThread("e"), Batches()
    release = _blocked(compute)
    merged = [compute.submit_batch(squares, items, max_items=3) for items in ([1], [-1])]
    alone = compute.submit_batch(squares, [2, 3], max_items=3)
    release.set()
    for part in merged:
        with pytest.raises(ValueError, match="a bad item"):
            part.result(10)
    assert alone.result(10) == [4, 9]


def test_a_batch_function_answering_the_wrong_number_fails_its_callers() -> None:
    compute = ComputeThread("n")
    with pytest.raises(RuntimeError, match="1 answers for 2 items"):
        compute.submit_batch(lambda items: items[:1], [1, 2], max_items=4).result(10)


def test_a_caller_that_gave_up_is_left_out_and_the_others_of_its_run_still_get_their_answers() -> None:
    """An asyncio caller whose task is cancelled (a client that went away) cancels its future through
    asyncio.wrap_future; the run must not compute its items nor stop answering the callers after it."""
    compute, squares = ComputeThread("c"), Batches()
    release = _blocked(compute)
    gone, kept = (compute.submit_batch(squares, items, max_items=4) for items in ([1, 2], [3]))
    assert gone.cancel()
    release.set()
    assert kept.result(10) == [9] and squares.runs == [[3]]
