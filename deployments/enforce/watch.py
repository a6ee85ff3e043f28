"""The measurement layer: a replica's memory watched by code the model does not run.

Two watchers apply the same decision (``gpubroker.broker.control.violation.watch_step``) to the same
reading (resident memory over the pre-model baseline on CPU; NVML's bytes for the pid on CUDA):

- ``ReplicaWatch``: a thread in the replica. Over grant + slack past the grace it declares the
  violation: the replica refuses new work (503 naming the model, the reading and the grant), its
  health check fails, and once drained it ends its own process (Serve starts a new one). Code in
  the model can stop it: it is the replica's courtesy, not the bound.
- the watchdog, outside every replica: ``PidWatch`` driven by the node's watch agent
  (``gpubroker.deployments.enforce.agent``), which takes each replica's grant from the broker, never
  from the replica; it ends the pid (SIGKILL) if the violation outlives the drain by ``BACKSTOP_S``.
  ``python -m gpubroker.deployments.enforce.watch`` runs one ``PidWatch`` on a grant fixed by its
  command line (tests, ``scripts/gpu-check``): its launcher, not the watched process, sets the grant.

Every step is one log line naming the model, the reading and the grant. docs/ENFORCEMENT.md
states the bound and how it is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gpubroker.broker.control.violation import (
    WATCH_DRAIN_S,
    WATCH_GRACE_S,
    WATCH_PERIOD_S,
    Verdict,
    WatchLimits,
    WatchResult,
    WatchState,
    watch_step,
)
from gpubroker.deployments.enforce.cgroup import ReplicaCgroup, find_place

logger = logging.getLogger("ray.serve")

BACKSTOP_S = 1.0  # the watchdog ends the pid this long after the replica should have ended itself
# The bound from the first reading over grant + slack to the process's end (its memory freed): the
# grace, the drain, the watchdog's backstop, and one reading period each for the start and the end.
END_BOUND_S = WATCH_GRACE_S + WATCH_DRAIN_S + BACKSTOP_S + 2 * WATCH_PERIOD_S
CGROUP_ENV = "GPUBROKER_CGROUP"  # "off": no cgroup even where writable (tests of the watcher alone)


def host_used_bytes(pid: int | None, baseline_bytes: int) -> int | None:
    """VmRSS of ``pid`` over ``baseline_bytes``; None when the pid is gone (or a zombie)."""
    from gpubroker.deployments.enforce.probes import proc_status_bytes

    rss = proc_status_bytes(pid).get("VmRSS")
    return None if rss is None else max(0, rss - baseline_bytes)


def nvml_reader(index: int, pid: int, baseline_bytes: int) -> Callable[[], int | None]:
    """NVML's bytes for ``pid`` on card ``index`` over ``baseline_bytes`` (its CUDA context), one
    NVML handle for all readings; NVML missing: 0 (the watchdog then only cleans up after the pid)."""
    from gpubroker.deployments.enforce.probes import NvmlProbe

    try:
        probe = NvmlProbe(index, pid)
    except Exception as exc:  # noqa: BLE001 - no NVML here: say so, read nothing
        _log(f"pid {pid}: NVML unavailable ({exc!r}): no reading on cuda:{index}")
        return lambda: 0
    return lambda: max(0, probe.process_bytes() - baseline_bytes)


MPS_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def set_mps_memory_limit(device: str, limit_bytes: int, environ: dict | None = None) -> str:
    """On CUDA under an MPS daemon (``CUDA_MPS_PIPE_DIRECTORY`` set, or its default pipe at
    /tmp/nvidia-mps): ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for this process, read by the CUDA
    runtime when it connects, so set before CUDA starts; fixed for the process's life (so the
    most the replica can be granted, quota.max per replica, plus the watcher's slack). Every
    allocation counts, torch's or not. Returns the value set, "" when none. Not run on this
    project's CPU machines: untested on a card."""
    env = os.environ if environ is None else environ
    if device == "cpu" or MPS_LIMIT_ENV in env:
        return ""
    if not (env.get("CUDA_MPS_PIPE_DIRECTORY") or os.path.exists("/tmp/nvidia-mps")):
        return ""
    from gpubroker.broker.control.violation import WATCH_SLACK_BYTES

    index = device.partition(":")[2] or "0"
    value = f"{index}={(int(limit_bytes) + WATCH_SLACK_BYTES) // 2**20}M"
    env[MPS_LIMIT_ENV] = value
    logger.info("gpubroker: %s=%s (MPS memory limit for this process)", MPS_LIMIT_ENV, value)
    return value


# ---------------------------------------------------------------------------------------------
# inside the replica


@dataclass(frozen=True)
class WatchReadings:
    """What the watcher thread reads for each ``watch_step``."""

    used: Callable[[], int | None]  # the replica's memory in use (None: the process's reading is gone)
    limits: Callable[[], WatchLimits]  # its grant, slack, grace and drain as of now
    lifted: Callable[[], str] = lambda: ""  # why the in-process limit is found lifted ("": it holds)


class ReplicaWatch:
    """The watcher thread of one replica: every ``period_s`` one ``watch_step``; the callbacks
    carry the steps out (``on_violation`` once, ``on_end`` once)."""

    def __init__(
        self,
        model: str,
        readings: WatchReadings,
        *,
        on_violation: Callable[[str], None] = lambda why: None,
        on_end: Callable[[str], None] = lambda why: None,
        clock: Callable[[], float] = time.monotonic,
        period_s: float = WATCH_PERIOD_S,
    ):
        self.model = model
        self.readings = readings
        self._on_violation, self._on_end = on_violation, on_end
        self._clock, self.period_s = clock, period_s
        self.state = WatchState()
        self.verdict = Verdict.WITHIN
        self.violation = ""  # the declared violation (the replica's 503 detail)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> WatchResult | None:
        used = self.readings.used()
        if used is None:
            return None
        res = watch_step(self.model, used, self.readings.limits(), self._clock(), self.state, self.readings.lifted())
        was, self.verdict, self.state = self.verdict, res.verdict, res.state
        if res.verdict == Verdict.OVER and was == Verdict.WITHIN:
            logger.warning("gpubroker watch: %s", res.reason)
        elif res.verdict == Verdict.WITHIN and was == Verdict.OVER:
            logger.info("gpubroker watch: model '%s' back within grant + slack inside the grace", self.model)
        elif res.verdict == Verdict.VIOLATION and not self.violation:
            self.violation = res.reason
            logger.warning("gpubroker watch: violation: %s", res.reason)
            self._on_violation(res.reason)
        elif res.verdict == Verdict.END and was != Verdict.END:
            logger.warning("gpubroker watch: %s", res.reason)
            self._on_end(res.reason)
        return res

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one reading
                logger.exception("gpubroker watch: model '%s': reading failed", self.model)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"gpubroker-watch-{self.model}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def end_own_process(why: str) -> None:
    """The replica's last step: SIGKILL itself (Serve sees the actor die and starts a new one)."""
    logger.warning("gpubroker watch: ending process %d: %s", os.getpid(), why)
    for h in logging.getLogger().handlers + logger.handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# the watchdog: outside the replica


def outside_limits(limits: WatchLimits) -> WatchLimits:
    """The limits an outside watcher applies: the replica's own, with the backstop added to the
    drain (the replica ends itself first when its watcher runs)."""
    return replace(limits, drain_s=limits.drain_s + BACKSTOP_S)


class PidWatch:
    """``watch_step`` for one process watched from outside it: its state, one log line per change
    of verdict; ``step`` says what to do (``Verdict.END``: end the pid now; None: the pid is gone)."""

    def __init__(self, model: str, pid: int, used: Callable[[], int | None], log: Callable[[str], None]):
        self.model, self.pid = model, pid
        self._used, self._log = used, log
        self.state, self.verdict = WatchState(), Verdict.WITHIN
        self.first_over_s: float | None = None  # first reading over grant + slack (the bound's start)

    def step(self, limits: WatchLimits | None, now_s: float) -> Verdict | None:
        if host_used_bytes(self.pid, 0) is None:  # the pid is gone (or a zombie), on any device
            return None
        used = self._used()
        if used is None:
            return None
        if limits is None:  # no grant from the broker yet: nothing to hold it to
            return Verdict.WITHIN
        res = watch_step(self.model, used, limits, now_s, self.state)
        if res.verdict != self.verdict and res.verdict != Verdict.WITHIN:
            self._log(f"pid {self.pid}: {res.verdict}: {res.reason}")
        if self.first_over_s is None and res.verdict != Verdict.WITHIN:
            self.first_over_s = now_s
        self.state, self.verdict = res.state, res.verdict
        return res.verdict


def end_pid(pid: int, log: Callable[[str], None]) -> bool:
    """SIGKILL ``pid`` (the replica did not end itself); False when it was already gone."""
    log(f"pid {pid}: SIGKILL (the replica did not end itself)")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _log(msg: str) -> None:
    print(f"gpubroker watchdog: {msg}", file=sys.stderr, flush=True)


def setup_cgroup(pid: int, model: str) -> tuple[ReplicaCgroup | None, str]:
    """The pid in a memory cgroup of its own (``gpubroker.deployments.enforce.cgroup``), or why not."""
    if os.environ.get(CGROUP_ENV, "").lower() == "off":
        return None, f"{CGROUP_ENV}=off"
    place = find_place(pid)
    if not place.writable:
        return None, place.why_not
    cg = ReplicaCgroup(place, f"gpubroker-{model}-{pid}")
    try:
        cg.create()
        cg.join(pid)
    except OSError as exc:
        cg.remove()
        return None, f"{cg.path}: {exc}"
    return cg, ""


def remove_cgroup(cg: ReplicaCgroup, tries: int = 50) -> None:
    """rmdir once the kernel emptied it (the process's exit completes after it is gone)."""
    for _ in range(tries):
        if not cg.remove():
            return
        time.sleep(0.1)


def used_reader(pid: int, device: str, baseline_bytes: int) -> Callable[[], int | None]:
    """What the watchdog reads of ``pid``: RSS over the baseline on cpu, NVML's bytes on a card."""
    if device == "cpu":
        return lambda: host_used_bytes(pid, baseline_bytes)
    return nvml_reader(int(device.partition(":")[2] or 0), pid, baseline_bytes)


def watchdog_main(argv: list[str] | None = None) -> int:
    """One pid held to a grant fixed on the command line, until the pid is gone."""
    ap = argparse.ArgumentParser(prog="python -m gpubroker.deployments.enforce.watch", description=__doc__)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--baseline", type=int, default=0, help="bytes the process held before the model loaded")
    ap.add_argument("--grant", type=int, required=True, help="the grant in bytes")
    ap.add_argument("--slack", type=int, default=WatchLimits(0).slack_bytes, help="bytes over the grant")
    ap.add_argument("--grace", type=float, default=WATCH_GRACE_S, help="seconds over grant + slack")
    ap.add_argument("--drain", type=float, default=WATCH_DRAIN_S, help="seconds from violation to the end")
    args = ap.parse_args(argv)
    limits = outside_limits(WatchLimits(args.grant, args.slack, args.grace, args.drain))
    cg, why_not = setup_cgroup(args.pid, args.model)
    if cg is None:
        _log(f"model '{args.model}' pid {args.pid}: no cgroup ({why_not}): the measurement layer holds alone")
    else:
        cg.set_limit(cg.limit_for(args.grant, args.slack))
    print(json.dumps({"cgroup": "" if cg is None else str(cg.path), "why_not": why_not}), flush=True)
    watch = PidWatch(args.model, args.pid, used_reader(args.pid, args.device, args.baseline), _log)
    while True:
        time.sleep(WATCH_PERIOD_S)
        verdict = watch.step(limits, time.monotonic())
        if verdict is None:
            break
        if verdict == Verdict.END:
            end_pid(args.pid, _log)
    if cg is not None:
        remove_cgroup(cg)
        _log(f"model '{args.model}' pid {args.pid} gone: cgroup {cg.path} removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(watchdog_main())
