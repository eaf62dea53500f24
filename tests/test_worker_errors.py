"""A Ray worker's failure reaches the person as its own exception line, without Ray's colour codes."""

from __future__ import annotations

import pytest

from poolbench.driver.work_queue import worker_death_cause

# ActorDiedError's text for an actor whose __init__ raised, as Ray 2.60 builds it (captured from a real run).
ACTOR_DIED = ("The actor died because of an error raised in its creation task, \x1b[36mray::Extractor.__init__()"
              "\x1b[39m (pid=25642, ip=127.0.0.1, actor_id=0701e2b7c4ae67d0d6b0483701000000)\n"
              "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
              '  File "/x/loading.py", line 6, in __init__\n'
              '    raise ModelLoadError("config.json: Expecting value")\n'
              "poolbench.errors.ModelLoadError: /m/config.json: not JSON (Expecting value: line 1 column 1)")


def test_the_worker_exception_line_is_found_and_colour_removed():
    assert worker_death_cause(RuntimeError(ACTOR_DIED)) == (
        "poolbench.errors.ModelLoadError: /m/config.json: not JSON (Expecting value: line 1 column 1)")
    assert worker_death_cause(RuntimeError("\x1b[31mworker gone\x1b[0m\nno traceback")) == "worker gone"


@pytest.mark.slow
def test_an_actor_that_cannot_start_is_reported_with_its_cause():
    import ray

    from poolbench.driver.work_queue import WorkQueueError, fetch

    @ray.remote(num_cpus=0)
    class Broken:
        def __init__(self) -> None:
            raise OSError("/models/m/config.json: Expecting value: line 1 column 1 (char 0)")

        def ping(self) -> int:
            return 1

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        with pytest.raises(WorkQueueError) as caught:
            fetch(Broken.remote().ping.remote(), "extractor for hedging")
    finally:
        ray.shutdown()
    assert str(caught.value) == ("extractor for hedging failed: its worker could not start: OSError: "
                                 "/models/m/config.json: Expecting value: line 1 column 1 (char 0)")
