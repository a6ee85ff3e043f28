"""The measurement layer: a replica's memory watched by code the model does not run.

Two watchers apply the same decision (``gpubroker.broker.control.violation.watch_step``) to the same
reading (resident memory over the pre-model baseline on CPU; NVML's bytes for the pid on CUDA):

- ``ReplicaWatch``: a thread in the replica. Over grant + slack past the grace it declares the
  violation: the replica refuses new work (503 naming the model, the reading and the grant), its
  health check fails, and once drained it ends its own process (Serve starts a new one).
- the watchdog: a process of its own (``python -m gpubroker.deployments.enforce.watch``), started by the replica
  before the model loads, outside its memory and its limits. It puts the replica's pid in a
  memory cgroup of its own where the node allows (``gpubroker.deployments.enforce.cgroup``) and sets the limit from
  every grant the replica sends it; it ends the pid (SIGKILL) if the violation outlives the drain
  by ``BACKSTOP_S``, and removes the cgroup once the pid is gone.

Every step is one log line naming the model, the reading and the grant (the watchdog's go to the
replica's stderr, the Ray worker log). docs/ENFORCEMENT.md states the bound and how it is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import subprocess
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


class WatchdogHandle:
    """The replica's end of its watchdog process: started before the model loads, told every
    grant. ``cgroup``: the replica's cgroup path ("" when none; ``why_not`` says why)."""

    def __init__(self, model: str, device: str, baseline_bytes: int, *, start_timeout_s: float = 10.0):
        self.model = model
        self.cgroup = ""
        self.why_not = ""
        cmd = [sys.executable, "-m", "gpubroker.deployments.enforce.watch", "--pid", str(os.getpid()), "--model", model]
        cmd += ["--device", device, "--baseline", str(int(baseline_bytes))]
        self.proc = subprocess.Popen(  # stderr: inherited (the worker's log)
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, start_new_session=True
        )
        out = self.proc.stdout
        assert out is not None  # stdout=PIPE
        ready, _, _ = select.select([out], [], [], start_timeout_s)
        line = out.readline() if ready else b""
        try:
            hello = json.loads(line or b"{}")
        except ValueError:
            hello = {}
        self.cgroup = str(hello.get("cgroup", ""))
        self.why_not = str(hello.get("why_not", "watchdog did not answer in time" if not line else ""))

    def send(self, limits: WatchLimits) -> None:
        """The replica's grant (and slack, grace, drain) as of now; the cgroup limit follows it."""
        msg = {"grant": limits.grant_bytes, "slack": limits.slack_bytes, "grace_s": limits.grace_s}
        msg["drain_s"] = limits.drain_s
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as exc:
            logger.warning(
                "gpubroker watch: model '%s': watchdog gone (%r): the in-process watcher holds", self.model, exc
            )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


# ---------------------------------------------------------------------------------------------
# the watchdog process


@dataclass
class _Watched:
    model: str
    pid: int
    limits: WatchLimits | None = None  # None until the replica sends its first grant


def _log(msg: str) -> None:
    print(f"gpubroker watchdog: {msg}", file=sys.stderr, flush=True)


def _setup_cgroup(pid: int, model: str):
    from gpubroker.deployments.enforce.cgroup import ReplicaCgroup, find_place

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


def _read_grants(w: _Watched, cg, eof: threading.Event) -> None:
    """Grant lines from the replica; the cgroup limit follows each one."""
    for raw in sys.stdin.buffer:
        try:
            msg = json.loads(raw)
            limits = WatchLimits(int(msg["grant"]), int(msg["slack"]), float(msg["grace_s"]), float(msg["drain_s"]))
        except (ValueError, KeyError, TypeError) as exc:
            _log(f"model '{w.model}': bad grant line {raw!r}: {exc}")
            continue
        w.limits = replace(limits, drain_s=limits.drain_s + BACKSTOP_S)
        if cg is not None:
            limit = cg.limit_for(limits.grant_bytes, limits.slack_bytes)
            err = cg.set_limit(limit)
            _log(
                f"model '{w.model}' pid {w.pid}: grant {limits.grant_bytes / 2**20:.1f} MiB: "
                + (f"cgroup limit not set ({err})" if err else f"cgroup limit {limit / 2**20:.1f} MiB")
            )
    eof.set()


def watchdog_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpubroker.deployments.enforce.watch", description=__doc__)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--baseline", type=int, default=0, help="bytes the process held before the model loaded")
    args = ap.parse_args(argv)
    w = _Watched(args.model, args.pid)
    cg, why_not = _setup_cgroup(args.pid, args.model)
    if cg is None:
        _log(f"model '{w.model}' pid {w.pid}: no cgroup ({why_not}): the measurement layer holds alone")
    print(json.dumps({"cgroup": "" if cg is None else str(cg.path), "why_not": why_not}), flush=True)
    if args.device == "cpu":
        used = lambda: host_used_bytes(args.pid, args.baseline)  # noqa: E731
    else:
        used = nvml_reader(int(args.device.partition(":")[2] or 0), args.pid, args.baseline)
    eof = threading.Event()
    threading.Thread(target=_read_grants, args=(w, cg, eof), daemon=True).start()
    state, verdict = WatchState(), Verdict.WITHIN
    while True:
        time.sleep(WATCH_PERIOD_S)
        if host_used_bytes(args.pid, 0) is None:  # the pid is gone (or a zombie), on any device
            break
        now_used = used()
        if now_used is None:
            break
        if w.limits is None:
            continue
        res = watch_step(w.model, now_used, w.limits, time.monotonic(), state)
        if res.verdict != verdict and res.verdict != Verdict.WITHIN:
            _log(f"pid {w.pid}: {res.verdict}: {res.reason}")
        state, verdict = res.state, res.verdict
        if res.verdict == Verdict.END:
            _log(f"pid {w.pid}: SIGKILL (the replica did not end itself)")
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if cg is not None:
        for _ in range(50):  # the kernel empties the cgroup as the process's exit completes
            if not cg.remove():
                break
            time.sleep(0.1)
        _log(f"model '{w.model}' pid {w.pid} gone: cgroup {cg.path} removed")
    return 0


if __name__ == "__main__":
    code = watchdog_main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the grant reader is a daemon thread blocked reading stdin: a normal exit finalizes stdin
    # under it and can abort the interpreter (SIGABRT, "could not acquire lock ... at shutdown")
    os._exit(code)
