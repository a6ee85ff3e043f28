"""The replica's units without Serve: the lazy gate, the fast loop and the broker link.

Each takes its clock (or its broker handle) as an argument; these tests step a fake clock in
integer ticks and use a fake broker handle (a stand-in for the Ray actor, said so below).
"""

from __future__ import annotations

import asyncio

from gpubroker.deployments.replica.broker_link import BrokerLink, ReplicaGauges
from gpubroker.deployments.replica.fast_loop import FastEvent, FastLoopParams, fast_loop_step
from gpubroker.deployments.replica.gate import LazyGate


class Clock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> float:
        return float(self.t)


# ------------------------------------------------------------------------------ gate
def test_gate_idle_admits_then_holds_while_a_batch_runs_and_releases_one_cap():
    clock = Clock()
    g: LazyGate[int] = LazyGate(max_concurrent_batches=1, cap=4, wait_s=2.0, clock=clock)
    assert g.admit(0, 1)  # idle: in at once, opens the forming window until t=2
    clock.t = 1
    assert g.admit(1, 1)  # still forming, under the cap
    g.settle(1)
    g.settle(1)
    g.batch_started()  # the batch of 2 runs
    held = [k for k in range(2, 12) if not g.admit(k, 1)]
    assert held == list(range(2, 12))  # every arrival during the batch waits
    g.batch_ended()
    assert g.pump() == [2, 3, 4, 5]  # one cap's worth, oldest first
    assert g.pump() == []  # nothing more until those run
    for _ in range(4):
        g.settle(1)
    g.batch_started()
    g.batch_ended()
    assert g.pump() == [6, 7, 8, 9]


def test_gate_closes_after_the_forming_window_and_skips_dead_tokens():
    clock = Clock()
    g: LazyGate[int] = LazyGate(max_concurrent_batches=1, cap=8, wait_s=1.0, clock=clock)
    assert g.admit(0, 1)
    clock.t = 2  # the forming batch's window has passed: a late one would start a batch of its own
    assert not g.admit(1, 1)
    g.settle(1)  # request 0 was cancelled inside the batcher: counted out
    assert g.pump(alive=lambda tok: tok != 1) == []  # 1 timed out while held: dropped, not released
    assert g.released == 0 and not g.held


def test_gate_first_released_item_may_exceed_the_cap():
    g: LazyGate[str] = LazyGate(max_concurrent_batches=1, cap=10, wait_s=0.0, clock=Clock())
    g.batch_started()
    assert not g.admit("big", 50) and not g.admit("small", 1)
    g.batch_ended()
    assert g.pump() == ["big"]  # runs alone (the batcher's batch_size_fn counts it as the cap)


# ------------------------------------------------------------------------------ fast loop
P = FastLoopParams(floor=2, emergency_free_frac=0.10, critical_free_factor=0.5, recover_step_frac=0.125)


def test_fast_loop_halves_pauses_and_recovers():
    out = fast_loop_step(0.05, 32, 32, False, P)
    assert (out.cap, out.paused, out.event, out.counted) == (16, False, FastEvent.SHRINK, True)
    cap = out.cap
    for _ in range(5):
        cap = fast_loop_step(0.05, cap, 32, False, P).cap
    assert cap == 2  # never below the floor
    out = fast_loop_step(0.05, 2, 32, False, P)
    assert out.paused and out.event == FastEvent.PAUSE and out.counted
    again = fast_loop_step(0.05, 2, 32, True, P)
    assert again.paused and not again.counted  # one pause counts once
    back = fast_loop_step(0.5, 2, 32, True, P)
    assert not back.paused and back.event == FastEvent.RECOVER and back.cap == 6  # + 1/8 of 32
    assert fast_loop_step(0.5, 30, 32, False, P).cap == 32  # never above the broker's cap


def test_fast_loop_without_a_reading_changes_nothing():
    out = fast_loop_step(None, 8, 32, True, P)
    assert (out.cap, out.paused, out.event) == (8, True, FastEvent.NONE)


# ------------------------------------------------------------------------------ broker link
class FakeBroker:
    """Stands in for the broker actor handle (``handle.report.remote(...)`` awaitable)."""

    def __init__(self) -> None:
        self.reports: list[dict] = []
        self.fail = False

    def __getattr__(self, name: str):
        broker = self

        class _M:
            def remote(self, *args):
                async def call():
                    if broker.fail:
                        raise ConnectionError("actor gone")
                    if name == "report":
                        broker.reports.append(args[0])
                    return {
                        "model": "m",
                        "version": 3,
                        "max_batch_size": 8,
                        "batch_wait_timeout_s": 0.01,
                        "grant_bytes": 1,
                        "admit": True,
                    }

                return call()

        return _M()


def test_link_merges_an_unsent_delta_and_never_loses_counts():
    clock = Clock()
    broker = FakeBroker()
    link = BrokerLink("m", "r1", lambda: broker, rpc_timeout_s=1.0, clock=clock)
    g = ReplicaGauges(queue_depth=3, mem_used_bytes=10, device_free_frac=0.5, sm_util_frac=None, settings_version=0)

    async def run():
        assert await link.register({}, 0) is not None and link.registered
        link.delta.arrivals += 5
        link.delta.add_latency(12.0)
        broker.fail = True
        clock.t = 1
        assert await link.report(g) is None and link.failures == 1
        link.delta.arrivals += 2  # more arrive while the broker is away
        broker.fail = False
        clock.t = 2
        reply = await link.report(g)
        assert reply is not None and reply.version == 3 and link.failures == 0

    asyncio.run(run())
    assert len(broker.reports) == 1
    rep = broker.reports[0]
    assert rep["arrivals"] == 7 and rep["latency_ms"] == (12.0,)  # the failed delta was merged, not lost
    assert rep["interval_s"] == 2.0 and rep["queue_depth"] == 3
