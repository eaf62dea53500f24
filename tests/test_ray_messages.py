"""Ray's raylet messages in a log that is not a terminal: no colour codes, one line each, a repeat not shown."""

from __future__ import annotations

import io

import pytest
import ray._private.ray_logging as ray_logging
import ray._private.worker as ray_worker

from poolbench.driver.ray_messages import message_kind, plain_ray_messages

LOST = ("\x1b[33mTask ExtractorWorker.pool_concepts failed. Retries remaining: 0. Actor 3f2a9c0d11e0ff4a77b1 died:"
        "\x1b[0m\n  File \"worker.py\", line 12, in pool\nray.exceptions.ActorDiedError: The actor died")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_raylet_messages_are_plain_single_lines_shown_once(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)
    monkeypatch.setattr(ray_logging, "_color", ray_logging._color)
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    plain_ray_messages(io.StringIO())
    again = LOST.replace("3f2a9c0d11e0ff4a77b1", "77aa00bb11cc22dd33ee")  # the next actor's retry: same kind
    for message in (LOST, again, "Raylet is terminated.\nLast 20 lines of the Raylet logs:"):
        ray_worker.print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False, "ip": "127.0.0.1",
                                       "localhost": "127.0.0.1"}, ignore_prefix=False)
    printed = capsys.readouterr().out
    assert "\x1b" not in printed
    assert printed.splitlines() == [
        "(raylet) Task ExtractorWorker.pool_concepts failed. Retries remaining: 0. Actor 3f2a9c0d11e0ff4a77b1 died:",
        "(raylet) Raylet is terminated."]


def test_a_terminal_keeps_rays_printer(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ray_worker.print_to_stdstream
    monkeypatch.setattr(ray_worker, "print_to_stdstream", original)
    plain_ray_messages(Terminal())
    assert ray_worker.print_to_stdstream is original


def test_message_kind_blanks_ids_and_counts() -> None:
    assert message_kind("Actor 3f2a9c0d11e0ff4a77b1 died after 2 retries") == "Actor # died after # retries"
