"""The watchdog's grants come from the broker's side (issue 52 item 4).

The pure parts: the hold of a lowered grant (``violation.watched_grant``, a fake clock in integer
ticks), the agent's ``GrantBook`` (a registration taken once per pid and only for the pid's own
deployment; the limit is the broker's grant over the replica's share, never more); and the agent
itself (``WatchAgent``, Ray left out: GCS's owner and the broker are stand-ins) against a real
child process that claims a larger grant through every door the agent has and still ends at the
broker's.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from gpubroker.broker.control.violation import (
    WATCH_SLACK_BYTES,
    GrantHold,
    lowered_grant_hold_s,
    watched_grant,
)
from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.enforce import agent as agent_mod
from gpubroker.deployments.enforce.agent import GrantBook, Registration, WatchAgent, serves
from gpubroker.deployments.enforce.watch import BACKSTOP_S

MiB = 1024**2


def reg(pid: int = 100, model: str = "small", card_replicas: int = 1, card_id: str = "") -> Registration:
    return Registration(model, card_id, card_replicas, pid, "cpu", 0)


def test_a_lowered_grant_is_watched_as_the_old_one_for_the_hold_then_binds():
    hold_s = lowered_grant_hold_s(2.0)
    assert hold_s == 10.0  # (HELD_RESTART_T 4 + 1) transfer timeouts
    g, h = watched_grant(GrantHold(), 256, 0.0, hold_s)
    assert g == 256
    g, h = watched_grant(h, 128, 1.0, hold_s)  # lowered at t=1
    assert g == 256
    g, h = watched_grant(h, 128, 10.0, hold_s)
    assert g == 256
    g, h = watched_grant(h, 128, 11.0, hold_s)  # the hold is over
    assert g == 128
    g, h = watched_grant(h, 512, 12.0, hold_s)  # a raise binds at once
    assert g == 512


def test_a_second_lowering_inside_the_hold_keeps_the_highest_grant():
    _, h = watched_grant(GrantHold(), 300, 0.0, 10.0)
    _, h = watched_grant(h, 200, 1.0, 10.0)
    g, h = watched_grant(h, 100, 2.0, 10.0)
    assert g == 300 and h.until_s == 12.0


def test_deployment_names_match_the_model_on_its_card():
    assert serves("small", "small", "")
    assert serves("small@card-1", "small", "card-1")
    assert not serves("big", "small", "")
    assert not serves("small@card-2", "small", "card-1")
    assert not serves("small@card-1", "small", "")


def test_the_limit_is_the_brokers_grant_over_the_replicas_share():
    book = GrantBook(hold_s=10.0)
    assert book.register(reg(card_replicas=2), owner="small") == ""
    assert book.limits(100, 0.0) is None  # no answer from the broker yet: nothing to hold it to
    book.set_grant("small", "", 512 * MiB)
    limits = book.limits(100, 0.0)
    assert limits is not None and limits.grant_bytes == 256 * MiB and limits.slack_bytes == WATCH_SLACK_BYTES
    assert limits.drain_s == pytest.approx(3.0 + BACKSTOP_S)  # the replica ends itself first


def test_a_second_registration_of_a_pid_cannot_claim_more():
    """Code in the model re-registers its replica (bigger share, another model): refused; the
    limit stays the broker's grant for the model it was registered as."""
    book = GrantBook(hold_s=10.0)
    assert book.register(reg(card_replicas=4), owner="small") == ""
    book.set_grant("small", "", 1024 * MiB)
    book.set_grant("big", "", 4096 * MiB)
    why = book.register(reg(card_replicas=1), owner="small")
    assert "registered as model 'small'" in why
    assert "registered as model 'small'" in book.register(reg(model="big"), owner="big")
    limits = book.limits(100, 0.0)
    assert limits is not None and limits.grant_bytes == 256 * MiB


def test_a_pid_is_taken_only_for_its_own_deployment():
    book = GrantBook(hold_s=10.0)
    assert "is a replica of deployment 'small', not of model 'big'" in book.register(reg(model="big"), owner="small")
    assert "no live Serve replica" in book.register(reg(pid=7), owner=None)  # a child the model started
    assert "card_replicas must be >= 1" in book.register(reg(card_replicas=0), owner="small")
    assert book.watched == {}


GROWER = """
import mmap, sys, time
print("ready", flush=True)
sys.stdin.readline()
held = []
for _ in range(40):
    m = mmap.mmap(-1, 8 * 2**20)  # shared: outside RLIMIT_DATA, resident
    m.write(b"x" * (8 * 2**20))
    held.append(m)
    time.sleep(0.02)
print("grown", flush=True)
time.sleep(120)
"""


class FakeBroker:
    """The broker's side: the only grant there is."""

    def __init__(self, grant_bytes: int):
        self.grant_bytes, self.calls = grant_bytes, 0

    async def settings(self, model: str, card_id: str = "") -> ModelSettings:
        self.calls += 1
        return ModelSettings(
            model=model, version=1, max_batch_size=4, batch_wait_timeout_s=0.01, grant_bytes=self.grant_bytes
        )


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_the_agent_ends_a_replica_at_the_brokers_grant_whatever_the_replica_claims(monkeypatch):
    """A real child (standing in for a replica, GCS's owner stubbed) registers with a 64 MiB
    grant at the broker, then claims more: a second registration as a bigger model and a nudge.
    It grows to 320 MiB; the agent holds it to 64 MiB + slack and SIGKILLs it past grace + drain."""
    monkeypatch.setenv("GPUBROKER_CGROUP", "off")
    child = subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    owners = {child.pid: "grower"}
    monkeypatch.setattr(agent_mod, "serve_replica_of", lambda pid, node: owners.get(pid))
    broker = FakeBroker(64 * MiB)

    async def scenario() -> dict:
        agent = WatchAgent("broker", "ns", "node", hold_s=10.0)
        agent._client = broker
        first = await agent.register("grower", "", 1, child.pid, "cpu", 0)
        assert first["accepted"], first
        owners[child.pid] = "bigger"  # even were GCS to say so, the pid is taken
        again = await agent.register("bigger", "", 1, child.pid, "cpu", 0)
        assert not again["accepted"] and "registered as model 'grower'" in again["why"]
        assert await agent.nudge(child.pid)  # a nudge carries no number: the broker is asked again
        child.stdin.write("grow\n")
        child.stdin.flush()
        t0 = time.monotonic()
        while child.poll() is None and time.monotonic() - t0 < 60:
            await asyncio.sleep(0.1)
        await asyncio.sleep(2 * 0.25)  # the agent sees the pid gone
        out = await agent.report()
        for task in agent._loops:
            task.cancel()
        return out

    try:
        report = asyncio.run(scenario())
        assert child.wait(timeout=5) == -9  # SIGKILL: the agent ended it
    finally:
        child.kill()
    (ended,) = report["ended"]
    assert ended["by"] == "watchdog" and ended["grant_bytes"] == 64 * MiB, ended
    assert broker.calls >= 2
