"""The control tick runs with the cyclic collector off and leaves it as it found it (broker.gc_hold).

Pure: the decorator on plain functions, and a ``BrokerCore`` / ``FleetBroker`` tick on a fake
clock whose policy step records whether the collector was on while it ran.
"""

from __future__ import annotations

import gc

import pytest

import broker.core as core_mod
from broker.core import BrokerCore
from broker.fleet_core import FleetBroker
from broker.gc_hold import gc_held
from tests.unit.test_oom import CONFIG, Clock


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_inside_and_on_after_a_return_or_a_raise():
    seen = []

    @gc_held
    def step(fail: bool = False) -> str:
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("boom")
        return "done"

    assert step() == "done" and seen == [False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        step(fail=True)
    assert seen == [False, False] and gc.isenabled()


def test_a_call_made_with_the_collector_off_leaves_it_off():
    @gc_held
    def inner() -> bool:
        return gc.isenabled()

    @gc_held
    def outer() -> tuple[bool, bool]:
        return inner(), gc.isenabled()  # the inner call must not turn it back on mid-outer

    assert outer() == (False, False) and gc.isenabled()
    gc.disable()
    assert inner() is False and not gc.isenabled()  # a caller's own choice stands


@pytest.mark.parametrize("fleet", [False, True])
def test_a_broker_tick_decides_with_the_collector_off(monkeypatch, fleet):
    seen: list[bool] = []
    decide = core_mod.policy.decide

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(gc.isenabled())
        return decide(*args, **kwargs)

    monkeypatch.setattr(core_mod.policy, "decide", recording)
    clock = Clock()
    broker = FleetBroker(CONFIG, clock=clock) if fleet else BrokerCore(CONFIG, clock=clock)
    for _ in range(3):
        clock.t += 1
        broker.tick()
    assert seen == [False, False, False] and gc.isenabled()


def test_tune_collector_sets_the_brokers_thresholds_and_returns_the_previous():
    from broker.gc_hold import BROKER_GC_THRESHOLDS, tune_collector

    was = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        assert tune_collector() == (700, 10, 10)
        assert gc.get_threshold() == BROKER_GC_THRESHOLDS != (700, 10, 10)
    finally:
        gc.set_threshold(*was)


def test_the_broker_actor_tunes_its_process_collector_when_it_starts(tmp_path):
    """``BrokerActor`` built in this process (no Ray: its checkpoint under tmp_path, metrics off)."""
    from broker.actor import BrokerActor
    from broker.gc_hold import BROKER_GC_THRESHOLDS

    was = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        BrokerActor(CONFIG, checkpoint_path=str(tmp_path / "ckpt.json"))
        assert gc.get_threshold() == BROKER_GC_THRESHOLDS
    finally:
        gc.set_threshold(*was)
