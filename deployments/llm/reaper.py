"""vLLM's engine processes end with the replica that started them, even when it is killed hard.

vLLM runs its engine core (and, on CPU, a worker under it) as processes of their own. A replica
that is stopped calls ``shutdown``; a replica that is killed (SIGKILL: the broker's violation
escalation, the kernel's OOM killer, a node agent) leaves them running, holding their KV cache
and a core, on a node its neighbours share. ``Reaper`` starts one small watcher process per
replica process (stdlib only) that holds the read end of a pipe: the replica writes the engine
processes it starts into it, and when the pipe closes (the replica ended, however) the watcher
kills those still alive. A process is named by its pid and its start time, so a reused pid is
never killed. Linux only (``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# The watcher: reads "pid start" lines ("pid -" forgets one); when its input ends or its parent is
# gone, SIGKILLs each one still alive with the same start time. Stdlib only: it starts in milliseconds.
_WATCHER = r"""
import os, select, signal, sys
parent = int(sys.argv[1])
def start(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except OSError:
        return None
held, buf = {}, b""
def take(chunk):
    global buf
    *lines, buf = (buf + chunk).split(b"\n")
    for line in lines:
        pid, began = line.decode().split()
        if began == "-":
            held.pop(pid, None)
        else:
            held[pid] = began
while os.getppid() == parent:  # a forked child may hold the pipe open: the parent's end is the signal too
    if not select.select([0], [], [], 1.0)[0]:
        continue
    chunk = os.read(0, 4096)
    if not chunk:
        break
    take(chunk)
while select.select([0], [], [], 0)[0]:  # what the parent wrote before it went
    chunk = os.read(0, 4096)
    if not chunk:
        break
    take(chunk)
for pid, began in held.items():
    if start(pid) == began:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""

PROC = Path("/proc")


def _stat_after_name(pid: int | str) -> list[bytes] | None:
    """``/proc/PID/stat`` from the state field on (the name may hold spaces); None if the process is gone."""
    try:
        return (PROC / str(pid) / "stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone."""
    fields = _stat_after_name(pid)
    return None if fields is None else fields[19].decode()


def descendants(pid: int) -> set[int]:
    """Every living process under ``pid`` (children, their children, ...), read from ``/proc``."""
    parent_of: dict[int, int] = {}
    for entry in PROC.iterdir():
        fields = _stat_after_name(entry.name) if entry.name.isdigit() else None
        if fields is not None:
            parent_of[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier and p not in found}
        found |= frontier
    return found


class Reaper:
    """One watcher process for this replica process; ``track`` the engine processes it should end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._held: dict[int, str] = {}

    @property
    def enabled(self) -> bool:
        return sys.platform.startswith("linux") and PROC.is_dir()

    def _watcher(self) -> subprocess.Popen[str]:
        """The watcher, started on first use and again if it ended (handed everything held so far)."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _WATCHER, str(os.getpid())],
                stdin=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self._write(self._proc, "".join(f"{pid} {began}\n" for pid, began in self._held.items()))
        return self._proc

    @staticmethod
    def _write(proc: subprocess.Popen[str], text: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text)
        proc.stdin.flush()

    def _send(self, line: str) -> None:
        try:
            self._write(self._watcher(), line + "\n")
        except OSError:  # the watcher ended between the check and the write: a new one is handed it all
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
            self._watcher()

    def track(self, pids: set[int]) -> list[int]:
        """Hand the watcher these processes (an engine's, started just now); the ones it took."""
        if not self.enabled:
            return []
        with self._lock:
            taken = []
            for pid in sorted(pids):
                began = start_time(pid)
                if began is None or self._held.get(pid) == began:
                    continue
                self._held[pid] = began
                self._send(f"{pid} {began}")
                taken.append(pid)
            return taken

    @contextmanager
    def tracking(self) -> Iterator[None]:
        """Hand the watcher every process started under this one inside the block (an engine's start)."""
        before = descendants(os.getpid()) if self.enabled else set()
        yield
        if self.enabled:
            self.track(descendants(os.getpid()) - before)

    def forget_gone(self) -> None:
        """Drop the processes that ended (call after an engine shut down)."""
        if not self.enabled:
            return
        with self._lock:
            for pid, began in list(self._held.items()):
                if start_time(pid) != began:
                    del self._held[pid]
                    self._send(f"{pid} -")

    def tracked(self) -> dict[int, str]:
        return dict(self._held)


REAPER = Reaper()  # one per replica process: every engine in it shares the watcher
