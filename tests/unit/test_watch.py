"""The measurement layer (issue 37): the watcher's decision as a pure function of readings, grant,
slack, grace and a fake clock (``gpubroker.broker.control.violation``); the replica's watcher thread's steps
(``gpubroker.deployments.enforce.watch.ReplicaWatch``, stepped by hand); the watchdog process against a real child
process that grows past its grant (a real SIGKILL); the fast loop's blame on a card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpubroker.broker.control.violation import Verdict, WatchLimits, WatchState, over_grant, watch_step
from gpubroker.deployments.enforce.watch import ReplicaWatch, WatchReadings, set_mps_memory_limit
from gpubroker.deployments.replica.fast_loop import FastEvent, FastLoopParams, fast_loop_step

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[2]
LIMITS = WatchLimits(grant_bytes=256 * MiB, slack_bytes=64 * MiB, grace_s=2.0, drain_s=3.0)


def run(readings: list[tuple[int, int]], limits: WatchLimits = LIMITS) -> list:
    """(tick in seconds, MiB used) each -> the verdicts, on a fake clock in integer ticks."""
    state, out = WatchState(), []
    for t, mib in readings:
        res = watch_step("lifter", mib * MiB, limits, float(t), state)
        state = res.state
        out.append(res)
    return out


def test_within_grant_plus_slack_is_no_violation():
    assert [r.verdict for r in run([(0, 0), (1, 256), (2, 320), (3, 320)])] == [Verdict.WITHIN] * 4


def test_over_inside_the_grace_then_back_under_resets_the_clock():
    out = run([(0, 321), (1, 400), (2, 300), (3, 400), (4, 400)])
    assert [r.verdict for r in out] == [Verdict.OVER, Verdict.OVER, Verdict.WITHIN, Verdict.OVER, Verdict.OVER]
    assert out[1].reason == "model 'lifter' uses 400.0 MiB over grant 256.0 MiB + slack 64.0 MiB for 1.00s (grace 2s)"


def test_over_past_the_grace_is_a_violation_naming_model_reading_and_grant_then_the_end_after_the_drain():
    out = run([(0, 400), (1, 500), (2, 600), (3, 100), (4, 100), (5, 100)])
    assert [r.verdict for r in out] == [
        Verdict.OVER,
        Verdict.OVER,
        Verdict.VIOLATION,
        Verdict.VIOLATION,  # sticky: back under does not undo it, the process still ends
        Verdict.VIOLATION,
        Verdict.END,  # drain_s (3) after the violation
    ]
    why = out[2].reason
    assert "model 'lifter'" in why and "600.0 MiB" in why and "grant 256.0 MiB" in why and "> grace 2s" in why
    assert out[2].state.violation_s == 2.0 and out[5].reason.endswith("drained 3s: end the process")


def test_a_limit_found_lifted_is_a_violation_at_once():
    res = watch_step("lifter", 0, LIMITS, 7.0, WatchState(), lifted="the limit was lifted (soft RLIMIT_DATA ...)")
    assert res.verdict == Verdict.VIOLATION and res.state.violation_s == 7.0
    assert "model 'lifter': the limit was lifted" in res.reason and "uses 0.0 MiB on a grant of 256.0 MiB" in res.reason


def test_limits_name_the_bad_field():
    with pytest.raises(ValueError, match="grace_s must be >= 0 seconds, got -1"):
        WatchLimits(grant_bytes=1, grace_s=-1)
    with pytest.raises(ValueError, match="grant_bytes must be >= 0, got -5"):
        WatchLimits(grant_bytes=-5)


def test_the_brokers_check_from_reports_counts_each_replicas_slack():
    assert not over_grant(256 * MiB + 64 * MiB, 256 * MiB, replicas=1)
    assert over_grant(256 * MiB + 65 * MiB, 256 * MiB, replicas=1)
    assert not over_grant(256 * MiB + 65 * MiB, 256 * MiB, replicas=2)


def test_replica_watch_steps_call_violation_once_and_end_once():
    clock, used = [0.0], [0]
    events: list[tuple[str, str]] = []
    w = ReplicaWatch(
        "hog",
        WatchReadings(lambda: used[0], lambda: LIMITS),
        on_violation=lambda why: events.append(("violation", why)),
        on_end=lambda why: events.append(("end", why)),
        clock=lambda: clock[0],
    )
    for t, mib in [(0, 10), (1, 500), (2, 500), (3, 500), (4, 500), (5, 500), (6, 10)]:
        clock[0], used[0] = float(t), mib * MiB
        w.step()
    assert [kind for kind, _ in events] == ["violation", "end"]
    assert w.violation == events[0][1] and "500.0 MiB" in w.violation
    used[0] = None  # type: ignore[assignment]  # the process's reading is gone: no step
    assert w.step() is None


def test_fast_loop_spares_a_replica_within_its_grant_on_a_short_card():
    p = FastLoopParams(floor=2, emergency_free_frac=0.1)
    assert fast_loop_step(0.01, 16, 16, False, p).event == FastEvent.SHRINK  # the old path: over its grant
    spared = fast_loop_step(0.01, 16, 16, False, p, within_grant=True)
    assert spared.event == FastEvent.NONE and spared.cap == 16 and not spared.paused
    resumed = fast_loop_step(0.01, 2, 16, True, p, within_grant=True)  # paused before: admits again
    assert not resumed.paused and resumed.cap > 2


def test_mps_limit_is_set_only_under_an_mps_daemon_and_only_on_cuda():
    env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"}
    assert set_mps_memory_limit("cpu", 256 * MiB, env) == ""
    assert set_mps_memory_limit("cuda:1", 256 * MiB, env) == "1=320M"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=320M"
    assert set_mps_memory_limit("cuda:1", 512 * MiB, env) == ""  # set already (by the operator or earlier)


GROWER = """
import sys, time
held = []
time.sleep(0.5)
for _ in range(60):
    held.append(bytearray(8 * 2**20))  # bytearray: outside torch
    time.sleep(0.05)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_the_watchdog_ends_a_process_over_its_grant_past_grace_and_drain():
    """A real child grows to 480 MiB against a 64 MiB grant; the watchdog (cgroup off: the
    measurement alone) declares the violation after the grace and SIGKILLs it after the drain."""
    from gpubroker.deployments.enforce.probes import proc_status_bytes

    env = {**os.environ, "GPUBROKER_CGROUP": "off"}
    victim = subprocess.Popen([sys.executable, "-c", GROWER])
    try:
        time.sleep(0.2)
        base = proc_status_bytes(victim.pid)["VmRSS"]
        cmd = [
            sys.executable,
            "-m",
            "gpubroker.deployments.enforce.watch",
            "--pid",
            str(victim.pid),
            "--model",
            "grower",
        ]
        limits = ["--grant", str(64 * MiB), "--slack", str(32 * MiB), "--grace", "1", "--drain", "1"]
        dog = subprocess.Popen(
            [*cmd, "--baseline", str(base), *limits],  # the grant from its launcher, never from the pid
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        hello = json.loads(dog.stdout.readline())
        assert hello == {"cgroup": "", "why_not": "GPUBROKER_CGROUP=off"}
        assert victim.wait(timeout=60) == -9  # SIGKILL: the watchdog ended it
        assert dog.wait(timeout=30) == 0
        log = dog.stderr.read()
    finally:
        victim.kill()
    assert "violation: model 'grower' uses" in log and "over grant 64.0 MiB + slack 32.0 MiB" in log, log
    assert f"pid {victim.pid}: SIGKILL" in log, log


def test_the_watchdogs_cuda_reading_is_nvml_bytes_for_the_pid_over_the_context(monkeypatch):
    """A FAKE NVML probe (no GPU here): one handle for every reading; NVML missing reads 0."""
    from gpubroker.deployments.enforce import probes
    from gpubroker.deployments.enforce.watch import nvml_reader

    made = []

    class FakeNvml:
        def __init__(self, index, pid):
            made.append((index, pid))

        def process_bytes(self):
            return 900 * MiB  # the context (600 MiB) + 300 MiB allocated outside torch

    monkeypatch.setattr(probes, "NvmlProbe", FakeNvml)
    read = nvml_reader(1, 4242, 600 * MiB)
    assert read() == 300 * MiB and read() == 300 * MiB and made == [(1, 4242)]

    def broken(index, pid):
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(probes, "NvmlProbe", broken)
    assert nvml_reader(0, 4242, 0)() == 0
