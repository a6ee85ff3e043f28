"""Two-phase quota moves through ``BrokerCore`` on a fake clock (issue 11, deliverables 2 and 3).

A confirmation needs a report, after the transfer began, from every live replica of the
donor; a release reaches the pool only once the releaser is measured under its new grant;
``apply`` lowers first; a reclaim the borrower does not honour escalates (caches, drain,
restart) and returns the owner's base within the bound stated in ``gpubroker.broker.control.lending``. At every
step: sum of max(grant + in flight, measured use) <= usable (``tests.unit.quota_fleet.check``).
"""

from __future__ import annotations

from gpubroker.broker.control.vocab import MoveKind
from tests.unit.quota_fleet import (
    MIB,
    Clock,
    Fleet,
    check,
    config,
    ledger_of,
    moves,
    new_core,
)

HOT_BASE = 128 * MIB


def setup(tmp_path, timeout_s: float = 60, replicas: int = 1):
    clock = Clock()
    core = new_core(tmp_path / "ckpt.json", clock, config(timeout_s, replicas=replicas))
    return core, Fleet(core, clock, replicas=replicas).start(), clock


def step(core, fleet, clock, busy, used, silent=frozenset(), core_log=True) -> None:
    clock.t += 0.5
    fleet.report_all(busy, used, silent)
    check(core, fleet, core_log)
    clock.t += 0.5
    core.tick()
    check(core, fleet, core_log)


HOT_BUSY = {"hot": True, "cold": False}
HOT_USES_ALL = {"hot": 1 << 40, "cold": 20 * MIB}  # hot fills whatever it runs under; cold idles at 20 MiB


def run_until(
    core, fleet, clock, pred, busy=HOT_BUSY, used=HOT_USES_ALL, limit=60, silent=frozenset(), core_log=True
) -> None:
    for _ in range(limit):
        if pred(core):
            return
        step(core, fleet, clock, busy, used, silent, core_log)
    raise AssertionError(f"not reached in {limit} steps: {ledger_of(core)!r}")


def lend_begun(core) -> bool:
    return any(t.kind == "lend" for t in ledger_of(core).pending)


def lent(core) -> bool:
    led = ledger_of(core)
    return not led.pending and led.grant("hot") > HOT_BASE


def test_silent_donor_is_never_confirmed(tmp_path):
    core, fleet, clock = setup(tmp_path, timeout_s=4)
    run_until(core, fleet, clock, lend_begun)
    t = ledger_of(core).pending[0]
    assert (t.donor, t.recipient) == ("cold", "hot")
    for _ in range(12):  # cold says nothing: no report, no confirmation, and the lend is aborted
        step(core, fleet, clock, HOT_BUSY, HOT_USES_ALL, silent=frozenset({"cold"}))
        assert ledger_of(core).grant("hot") == HOT_BASE
    assert not moves(core, "confirm")
    aborts = moves(core, "abort")
    assert aborts and aborts[0]["donor"] == "cold"
    assert "replicas reporting" in aborts[0]["reason"] or "no report" in aborts[0]["reason"], aborts[0]["reason"]


def test_donor_reporting_on_old_settings_is_not_confirmed(tmp_path):
    """Reports keep arriving, but one replica of two still runs the settings before the lend."""
    core, fleet, clock = setup(tmp_path, timeout_s=4, replicas=2)
    run_until(core, fleet, clock, lend_begun)
    stuck = fleet.live("cold")[0]
    old_version = stuck.settings["version"]
    for _ in range(6):
        clock.t += 0.5
        for rep in fleet.live("cold"):
            if rep is stuck:  # it reports, but never applies the lowered settings it gets back
                keep = dict(rep.settings)
                fleet.report(rep, False, 10 * MIB)
                rep.settings = {**keep, "version": old_version}
            else:
                fleet.report(rep, False, 10 * MIB)
        for rep in fleet.live("hot"):
            fleet.report(rep, True, 1 << 40)
        check(core, fleet)
        clock.t += 0.5
        core.tick()
        check(core, fleet)
    assert not moves(core, "confirm")
    assert ledger_of(core).grant("hot") == HOT_BASE


def test_restarted_broker_confirms_nothing_before_reports(tmp_path):
    core, fleet, clock = setup(tmp_path)
    run_until(core, fleet, clock, lend_begun)
    hot_before = ledger_of(core).grant("hot")
    for _ in range(3):  # killed right after the begin; the new broker ticks before any report
        core = new_core(tmp_path / "ckpt.json", clock, config())
        assert core.restored
        fleet.core = core
        clock.t += 1.0
        core.tick()
        check(core, fleet)
        assert ledger_of(core).pending and ledger_of(core).grant("hot") == hot_before
    assert not moves(core, "confirm")
    # once cold reports on the lowered settings, measured under them, the transfer completes
    run_until(core, fleet, clock, lent)
    confirms = moves(core, "confirm")
    assert len(confirms) == 1 and "reported" in confirms[0]["reason"]


def test_release_stays_pending_until_measured(tmp_path):
    core, fleet, clock = setup(tmp_path)
    run_until(core, fleet, clock, lent)
    idle_small = {"hot": 50 * MIB, "cold": 20 * MIB}
    run_until(
        core, fleet, clock, lambda c: any(t.kind == "release" for t in ledger_of(c).pending), busy={}, used=idle_small
    )
    led = ledger_of(core)
    release = next(t for t in led.pending if t.kind == "release")
    free, cold = led.free_bytes, led.grant("cold")
    # hot holds memory above its lowered grant (a cache it has not freed): the pool gets nothing
    holding = {"hot": led.grant("hot") + 40 * MIB, "cold": 20 * MIB}
    for rep in fleet.live("hot"):
        rep.used = holding["hot"]
    for _ in range(6):
        step(core, fleet, clock, {}, {"hot": None, "cold": 20 * MIB})
        led = ledger_of(core)
        assert [t.id for t in led.pending if t.kind == "release"] == [release.id]
        assert led.free_bytes == free and led.grant("cold") == cold
    # measured under its grant: the release completes and cold, under its base, gets it back
    step(core, fleet, clock, {}, idle_small)
    led = ledger_of(core)
    assert not led.pending
    assert any(m["donor"] == "hot" and m["recipient"] is None for m in moves(core, "confirm"))
    assert ledger_of(core).grant("cold") == cold + release.amount_bytes  # the released bytes, no more


def test_apply_lowers_before_it_raises(tmp_path):
    core, fleet, clock = setup(tmp_path)
    run_until(core, fleet, clock, lent)
    for _ in range(2):  # hot learns its raised grant (a reply), then fills it (next report)
        step(core, fleet, clock, HOT_BUSY, HOT_USES_ALL)
    hot = ledger_of(core).grant("hot")
    assert fleet.true_used()["hot"] == hot > 256 * MIB
    cold = ledger_of(core).grant("cold")
    out = core.apply(config(hot_max="256MiB"))
    assert out["ok"], out
    led = ledger_of(core)
    # the lowered grant is in force at once; its bytes are on their way back, not free
    assert led.grant("hot") == 256 * MIB and core.settings("hot").grant_bytes == 256 * MIB
    assert [(t.kind, t.amount_bytes) for t in led.pending] == [("release", hot - 256 * MIB)]
    assert led.free_bytes == 0 and led.grant("cold") == cold
    check(core, fleet)
    for _ in range(5):  # hot still holds its old memory: nothing rises
        step(core, fleet, clock, {}, {"hot": None, "cold": 20 * MIB})
        assert ledger_of(core).grant("cold") == cold and ledger_of(core).pending
    step(core, fleet, clock, {}, {"hot": 100 * MIB, "cold": 20 * MIB})  # measured under 256 MiB
    step(core, fleet, clock, {}, {"hot": 100 * MIB, "cold": 20 * MIB})
    led = ledger_of(core)
    assert not led.pending and led.grant("cold") > cold


def test_reclaim_escalates_and_returns_base_within_the_bound(tmp_path):
    timeout_s = 4.0
    core, fleet, clock = setup(tmp_path, timeout_s=timeout_s)
    run_until(core, fleet, clock, lent)
    for _ in range(2):  # hot learns its raised grant, then fills it
        step(core, fleet, clock, HOT_BUSY, HOT_USES_ALL)
    borrowed = ledger_of(core).grant("hot")
    both_busy = {"hot": True, "cold": True}
    # cold's load returns; hot holds every byte it borrowed and ignores caches and drain
    run_until(
        core,
        fleet,
        clock,
        lambda c: any(t.kind == "reclaim" for t in ledger_of(c).pending),
        busy=both_busy,
        used={"hot": None, "cold": 20 * MIB},
    )
    begun = clock.t
    assert fleet.true_used()["hot"] == borrowed > ledger_of(core).grant("hot")
    run_until(
        core,
        fleet,
        clock,
        lambda c: ledger_of(c).grant("cold") >= 256 * MIB,
        busy=both_busy,
        used={"hot": None, "cold": 20 * MIB},
        limit=40,
        core_log=False,
    )
    returned = clock.t
    # The core counts the restarted replica's last report until it is stale_after_s old, beside
    # its replacement's: it logs that overlap (real if Serve starts the new process before the
    # old one exits; the fake kills the old one first). Nothing else may break the invariant.
    restarted = next(m["time_s"] for m in moves(core, MoveKind.RECLAIM_RESTART))
    logged = [d for d in core.decisions() if d["kind"] == "invariant"]
    overlap_s = 0.5 + max(2.0, 5 * 0.5)  # the old replica learns of the restart at its next report, then goes stale
    assert all(restarted < d["time_s"] <= restarted + overlap_s and "hot" in d["reason"] for d in logged), logged
    kinds = [m["move"] for m in moves(core) if m["donor"] == "hot" and m["move"].startswith("reclaim")]
    assert kinds == ["reclaim", MoveKind.RECLAIM_CACHE, MoveKind.RECLAIM_DRAIN, MoveKind.RECLAIM_RESTART], kinds
    times = {m["move"]: m["time_s"] for m in moves(core) if m["donor"] == "hot"}
    for before, after in (
        ("reclaim", MoveKind.RECLAIM_CACHE),
        (MoveKind.RECLAIM_CACHE, MoveKind.RECLAIM_DRAIN),
        (MoveKind.RECLAIM_DRAIN, MoveKind.RECLAIM_RESTART),
    ):
        assert times[after] - times[before] >= timeout_s, times
    # what the replicas ran: caches released, then admission paused, then a restart
    assert [r.alive for r in fleet.reps["hot"]] == [False, True]
    # the bound of gpubroker.broker.control.lending: 3 T + restart + stale_after_s + control_interval_s, the fake's
    # restart being one report interval (the new replica registers, then reports)
    stale_after_s = max(2.0, 5 * 0.5)
    bound_s = 3 * timeout_s + 2 * 0.5 + stale_after_s + 1.0
    assert 3 * timeout_s <= returned - begun <= bound_s, (returned - begun, bound_s)
    assert not ledger_of(core).pending


def test_restart_is_asked_for_once_while_serve_replaces_the_replica(tmp_path):
    """A second token bump while the replacement starts would kill a healthy replacement."""
    timeout_s = 2.0
    core, fleet, clock = setup(tmp_path, timeout_s=timeout_s)
    fleet.restart_on_token = False  # Serve is slow: the old replica lingers, still holding
    run_until(core, fleet, clock, lent)
    for _ in range(2):
        step(core, fleet, clock, HOT_BUSY, HOT_USES_ALL)
    both_busy = {"hot": True, "cold": True}
    run_until(
        core,
        fleet,
        clock,
        lambda c: any(t.kind == "reclaim" for t in ledger_of(c).pending),
        busy=both_busy,
        used={"hot": None, "cold": 20 * MIB},
    )
    for _ in range(int(8 * timeout_s)):  # four times the restart step's delay
        step(core, fleet, clock, both_busy, {"hot": None, "cold": 20 * MIB})
    assert len(moves(core, MoveKind.RECLAIM_RESTART)) == 1
    assert core.settings("hot").restart_token == 1 and ledger_of(core).pending
