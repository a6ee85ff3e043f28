"""Shared pieces of the reliability tests: results file, fault counting, fake broker link, listeners, RSS.

A reliability test counts its faults with ``Faults``: one ``check(what, survived)`` per fault
injected, where ``survived`` is what the test observed after it (requests answered or refused
explicitly, grants and ledger as expected, the process back). The row it writes takes its
injected and survived counts from those checks, never from a constant::

    {"test", "nodeid", "fault", "kind", "faults_injected", "faults_survived", "checks",
     "counting", "sent", "answered", "refused", "lost", "answered_by", "refused_by", "lost_by",
     "figure", "ok"}

Its requests come from a ``Tally`` (``tests/chaos/tally.py``), the one count of every row:
sent = answered + refused (by status) + lost (by cause), every request the test sent included;
``record`` takes it as a required argument (a row that sends nothing passes an empty one and
says 0 sent) and refuses a tally that does not add up. A row with a lost request fails. Each such
test carries ``@pytest.mark.chaos``: ``tests/conftest.py`` writes what it expects at collection
and a failing row when one fails, and ``tests/chaos/report.py`` fails on a failed or missing row
or one whose count does not add up. Rows are written only when ``$GPUBROKER_CHAOS_RESULTS``
names the file (``make chaos`` sets it), so ``make test`` leaves no files behind.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpubroker.broker.wire import ModelSettings, StatsReport
from tests.chaos.tally import Tally

ROOT = Path(__file__).resolve().parents[2]


def results_path() -> Path:
    return Path(os.environ.get("GPUBROKER_CHAOS_RESULTS") or ROOT / "bench" / "out" / "chaos-results.jsonl")


def recording() -> bool:
    """Rows are written only under ``make chaos`` (it sets GPUBROKER_CHAOS_RESULTS)."""
    return bool(os.environ.get("GPUBROKER_CHAOS_RESULTS"))


class FaultKind(StrEnum):
    """What a fault is, so that the table never lets one kind hide another."""

    MALFORMED_INPUT = "malformed input"
    BAD_CONFIG = "bad config"
    OVERLOAD = "overload"
    PROCESS_KILLED = "process killed"
    NODE_KILLED = "node killed"
    BROKER_RESTARTED = "broker restarted"
    NETWORK = "network"
    MEMORY = "memory"
    NONE = "no fault"  # a check with nothing injected (listeners bind loopback)


def current_test() -> str:
    """The running pytest node id (pytest sets PYTEST_CURRENT_TEST), or '' outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def write_row(row: dict[str, Any]) -> dict[str, Any]:
    """Append one JSON line to the results file under ``make chaos`` (never fails the test)."""
    if not recording():
        return row
    try:
        path = results_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
    except OSError:
        pass
    return row


class Faults:
    """The faults one scenario injects, each with what was observed after it."""

    def __init__(self, test: str, fault: str, kind: FaultKind):
        self.test, self.fault, self.kind = test, fault, kind
        self.observed: list[tuple[str, bool]] = []

    def check(self, what: str, survived: bool) -> bool:
        """One fault injected; ``survived`` is the state the test checked after it."""
        self.observed.append((what, bool(survived)))
        return bool(survived)

    def failures(self) -> list[str]:
        return [what for what, ok in self.observed if not ok]

    def record(self, requests: Tally, *, ok: bool = True, figure: str = "", **extra: Any) -> dict[str, Any]:
        """Write the row: injected and survived are counted from the checks, the requests from
        ``requests`` (checked: it must add up); no check, a failed one or a lost request fails it."""
        requests.check(f"{self.test}: {self.fault}")
        survived = sum(1 for _, good in self.observed if good)
        row = {
            "time_s": round(time.time(), 3),
            "test": self.test,
            "nodeid": current_test(),
            "fault": self.fault,
            "kind": str(self.kind),
            "faults_injected": len(self.observed),
            "faults_survived": survived,
            "checks": [what for what, _ in self.observed][:8],
            "failed_checks": self.failures()[:8],
            **extra,
            **requests.to_row(),
            "figure": figure,
            "ok": bool(ok) and bool(self.observed) and survived == len(self.observed) and requests.n_lost == 0,
        }
        return write_row(row)


def observation(test: str, what: str, *, ok: bool, figure: str = "", **extra: Any) -> dict[str, Any]:
    """A row with no fault injected (a property checked once, such as loopback listeners)."""
    row = {
        "time_s": round(time.time(), 3),
        "test": test,
        "nodeid": current_test(),
        "fault": what,
        "kind": str(FaultKind.NONE),
        "faults_injected": 0,
        "faults_survived": 0,
        **extra,
        **Tally().to_row(),  # it sends no request: 0 sent, said as such
        "figure": figure,
        "ok": bool(ok),
    }
    return write_row(row)


# ------------------------------------------------------------------------- fake broker link
class _Remote:
    """``handle.method.remote(...)`` for an in-process callable: returns a coroutine."""

    def __init__(self, owner: CoreLink, name: str):
        self.owner, self.name = owner, name

    def remote(self, *args: Any, **kwargs: Any):
        async def call():
            if self.owner.down:
                raise ConnectionError("broker is down (test)")
            self.owner.calls[self.name] += 1
            if self.name == "report":  # plain data over Ray, typed inside (gpubroker.broker.actor does the same)
                call_args: tuple[Any, ...] = (StatsReport.from_dict(args[0]), *args[1:])
            else:
                call_args = args
            out = getattr(self.owner.core, self.name)(*call_args, **kwargs)
            return out.to_dict() if isinstance(out, ModelSettings) else out

        return call()


class CoreLink:
    """Stands in for the broker actor handle in front of a real ``BrokerCore`` (no Ray)."""

    def __init__(self, core: Any):
        self.core = core
        self.down = False
        self.calls: Counter = Counter()

    def __getattr__(self, name: str) -> _Remote:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Remote(self, name)


class FakeProbe:
    """A memory probe whose reading the test sets (process bytes = baseline + used)."""

    def __init__(self, capacity_bytes: int, process_bytes: int = 0):
        self.capacity_bytes = capacity_bytes
        self.process_bytes = process_bytes
        self.enforced: list[int | None] = []

    def read(self):
        from gpubroker.deployments.enforce.probes import MemoryReading

        used = self.process_bytes
        return MemoryReading(self.capacity_bytes, used, used, max(0.0, 1.0 - used / self.capacity_bytes), None)

    def enforce(self, grant_bytes: int | None) -> None:
        self.enforced.append(grant_bytes)


# ------------------------------------------------------------------------- processes
def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from /proc (no psutil)."""
    with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t_s, value) in value units per minute (0 for < 3 samples)."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 60.0


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(int(target[8:-1]))
    except OSError:
        pass
    return out


def _decode_addr(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", struct.unpack(">I", raw)[0]))
    words = struct.unpack("<4I", raw)
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listeners(pids: Iterable[int]) -> list[dict[str, Any]]:
    """TCP sockets in LISTEN held by ``pids``: [{"pid", "host", "port", "comm"}] from /proc/net/tcp{,6}."""
    by_inode: dict[int, int] = {}
    for pid in pids:
        for inode in _socket_inodes(pid):
            by_inode[inode] = pid
    out = []
    for path, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "0A":  # 0A = LISTEN
                continue
            inode = int(parts[9])
            if inode not in by_inode:
                continue
            addr, port = parts[1].split(":")
            pid = by_inode[inode]
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = "?"
            out.append({"pid": pid, "host": _decode_addr(addr, v6), "port": int(port, 16), "comm": comm})
    return out


def pids_in_group(pgid: int) -> list[int]:
    """Processes in process group ``pgid`` and all their descendants (Ray workers start their own)."""
    parent: dict[int, int] = {}
    roots: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parent[pid], group = int(fields[1]), int(fields[2])
        except (OSError, ValueError, IndexError):
            continue
        if group == pgid:
            roots.add(pid)
    out = set(roots)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parent.items():
            if pid not in out and ppid in out:
                out.add(pid)
                changed = True
    return sorted(out)


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "::ffff:127.0.0.1") or host.startswith("127.")


def wait_for(pred: Callable[[], Any], timeout_s: float, interval_s: float = 0.25, what: str = "condition") -> Any:
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def metric_label_values(text: str) -> dict[str, set[str]]:
    """Prometheus exposition text -> label name -> every value seen (gpubroker_* series only)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("gpubroker_"):
            continue
        for sample in family.samples:
            for key, value in sample.labels.items():
                out.setdefault(key, set()).add(value)
    return out


def grants_fit(settings: Mapping[str, Mapping[str, Any]], usable: int) -> bool:
    return sum(int(s["grant_bytes"]) for s in settings.values()) <= usable
