"""A kernel memory limit per replica process: its own memory cgroup, written from outside it.

Where the node's memory cgroup is writable (v1: ``memory.limit_in_bytes``; v2: ``memory.max``),
the watchdog (``gpubroker.deployments.enforce.watch``) makes a child of the replica's current cgroup, moves the
replica's pid into it and sets the limit from the grant; every grant change sets it again at
run time. Past the limit the kernel reclaims, then kills the process (Serve starts a new one).
Where it is not writable (an unprivileged container) ``find_place`` says why, once, and the
replica runs on the measurement layer alone.

Charges made before the move stay with the old cgroup (neither version moves them by default),
so the limit counts what the process touches after it joined: ``limit = usage at join + grant +
slack + margin``. The paths are arguments: tests lay out a temporary directory like cgroupfs.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

MiB = 1024**2
CGROUP_MARGIN_BYTES = 64 * MiB  # over grant + slack: the in-process limit and the watcher answer first


class CgroupVersion(StrEnum):
    V1 = "v1"
    V2 = "v2"


_LIMIT = {CgroupVersion.V1: "memory.limit_in_bytes", CgroupVersion.V2: "memory.max"}
_USAGE = {CgroupVersion.V1: "memory.usage_in_bytes", CgroupVersion.V2: "memory.current"}
_PEAK = {CgroupVersion.V1: "memory.max_usage_in_bytes", CgroupVersion.V2: "memory.peak"}
_OOM = {CgroupVersion.V1: "memory.oom_control", CgroupVersion.V2: "memory.events"}  # each has an "oom_kill N" line


@dataclass(frozen=True)
class CgroupPlace:
    """Where a replica's cgroup can go, or why none can."""

    version: CgroupVersion | None
    parent: Path | None  # the pid's current memory cgroup directory
    why_not: str = ""  # empty when writable

    @property
    def writable(self) -> bool:
        return self.parent is not None and not self.why_not


def find_place(
    pid: int | str = "self", proc_root: Path = Path("/proc"), fs_root: Path = Path("/sys/fs/cgroup")
) -> CgroupPlace:
    """The pid's memory cgroup (v1's ``memory`` controller line first, else the v2 line) and
    whether a child can be made there with a limit."""
    try:
        lines = (proc_root / str(pid) / "cgroup").read_text().splitlines()
    except OSError as exc:
        return CgroupPlace(None, None, f"cannot read {proc_root}/{pid}/cgroup: {exc}")
    v1 = v2 = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = rel
        elif controllers == "":
            v2 = rel
    if v1 is not None:
        version, parent = CgroupVersion.V1, fs_root / "memory" / v1.lstrip("/")
    elif v2 is not None and (fs_root / "cgroup.controllers").exists():
        version, parent = CgroupVersion.V2, fs_root / v2.lstrip("/")
        if "memory" not in (fs_root / "cgroup.controllers").read_text().split():
            return CgroupPlace(version, parent, "cgroup v2 without the memory controller")
    else:
        return CgroupPlace(None, None, "no memory cgroup mounted at " + str(fs_root))
    if not parent.is_dir():
        return CgroupPlace(version, parent, f"{parent} does not exist")
    if not os.access(parent, os.W_OK):
        return CgroupPlace(version, parent, f"{parent} is not writable (an unprivileged container?)")
    return CgroupPlace(version, parent)


class ReplicaCgroup:
    """One replica process's memory cgroup: ``create``, ``join(pid)``, ``set_limit``, ``remove``."""

    def __init__(self, place: CgroupPlace, name: str):
        if not place.writable or place.version is None or place.parent is None:
            raise ValueError(f"cgroup place is not writable: {place.why_not or place}; run on the watcher alone")
        self.version = place.version
        self.path = place.parent / name
        self.joined_usage_bytes = 0  # what was charged here right after the pid joined
        self.limit_bytes: int | None = None

    def create(self) -> None:
        self.path.mkdir(exist_ok=True)
        if self.version == CgroupVersion.V2 and not (self.path / "memory.max").exists():
            raise OSError(errno.ENOENT, f"{self.path}/memory.max missing: the parent does not delegate memory")

    def join(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(int(pid)))
        self.joined_usage_bytes = self.usage_bytes()

    def usage_bytes(self) -> int:
        try:
            return int((self.path / _USAGE[self.version]).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def peak_bytes(self) -> int | None:
        """The most the cgroup held (None: the kernel does not say)."""
        try:
            return int((self.path / _PEAK[self.version]).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int | None:
        """Processes the kernel killed in this cgroup for its limit (None: not counted here)."""
        try:
            lines = (self.path / _OOM[self.version]).read_text().splitlines()
        except OSError:
            return None
        found = [line.split()[1] for line in lines if line.startswith("oom_kill ")]
        return int(found[0]) if found else None

    def limit_for(self, grant_bytes: int, slack_bytes: int) -> int:
        return self.joined_usage_bytes + int(grant_bytes) + int(slack_bytes) + CGROUP_MARGIN_BYTES

    def set_limit(self, limit_bytes: int) -> str:
        """Write the limit; returns "" or why it was not set (v1 refuses a limit under what the
        cgroup holds and cannot reclaim: EBUSY; the old limit stays, the watcher still holds)."""
        try:
            (self.path / _LIMIT[self.version]).write_text(str(int(limit_bytes)))
        except OSError as exc:
            return f"{self.path / _LIMIT[self.version]} <- {int(limit_bytes)}: {exc}"
        self.limit_bytes = int(limit_bytes)
        return ""

    def read_limit(self) -> int | None:
        raw = (self.path / _LIMIT[self.version]).read_text().strip()
        return None if raw == "max" else int(raw)

    def remove(self) -> str:
        """rmdir once the pid is gone (an emptied cgroup); returns "" or why not."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"rmdir {self.path}: {exc}"
        return ""


__all__ = ["CGROUP_MARGIN_BYTES", "CgroupPlace", "CgroupVersion", "ReplicaCgroup", "find_place"]
