"""The processes cluster-up started, read from /proc: who belongs to a recorded group, and is a pid still ours.

A pid file alone cannot tell our process from a stranger that reused its pid, so each record keeps the kernel's
start time of the process as well; cluster-down signals a pid only while both still match.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    pgid: int
    start_ticks: int


def proc_stat(pid: int) -> ProcStat | None:
    """The fields of /proc/<pid>/stat we need, or None once the process is gone (or a zombie)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return ProcStat(pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), start_ticks=int(fields[19]))


def all_stats() -> list[ProcStat]:
    stats = []
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := proc_stat(int(entry.name))) is not None:
            stats.append(stat)
    return stats


def is_ours(pid: int, start_ticks: int) -> bool:
    """The recorded process is still alive and is the same process (not a later one that got its pid)."""
    stat = proc_stat(pid)
    return stat is not None and stat.start_ticks == start_ticks


def members(leader: int) -> dict[int, int]:
    """Every live process in the leader's process group and every descendant of those: {pid: start_ticks}."""
    stats = {s.pid: s for s in all_stats()}
    found = {pid for pid, s in stats.items() if s.pgid == leader}
    children: dict[int, list[int]] = {}
    for s in stats.values():
        children.setdefault(s.ppid, []).append(s.pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {pid: stats[pid].start_ticks for pid in found}


def _reap(pid: int) -> None:
    """Collect the exit status when the leader is our own child (cluster-up rolling back), so it is not a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_tree(leader: int, start_ticks: int, grace_s: float = 20.0) -> tuple[int, bool]:
    """SIGTERM the leader only (it shuts its own children down in order), wait for the whole tree, SIGKILL leftovers.

    Returns (processes stopped, whether all exited within the grace period); (0, True) when the leader is not ours.
    """
    if not is_ours(leader, start_ticks):
        return 0, True
    tree = members(leader)
    with contextlib.suppress(ProcessLookupError):
        os.kill(leader, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(leader)
        if not any(is_ours(pid, ticks) for pid, ticks in tree.items()):
            return len(tree), True
        if is_ours(leader, start_ticks):
            tree |= members(leader)
        time.sleep(0.05)
    for pid, ticks in tree.items():
        if is_ours(pid, ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _reap(leader)
    return len(tree), False
