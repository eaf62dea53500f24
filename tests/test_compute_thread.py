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
