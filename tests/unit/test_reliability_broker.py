"""Reliability of the broker without Ray: a broker killed in each phase of a quota transfer,
a checkpoint write cut short, and bad configs through ``apply``.

The broker is ``BrokerCore`` with a fake clock; "killing" it drops the object (nothing it
held in memory survives) and "restarting" builds a new one on the same checkpoint file, as
the detached actor does after ``ray.kill(handle, no_restart=False)``. A fake fleet drives it
with the same reports replicas send: ``hot`` busy and memory-bound, ``cold`` idle, so the
policy lends quota cold -> hot in two phases (begin: cold's grant drops; confirm: once cold
runs the lowered settings and reports memory under them, hot's grant rises).

At every step: sum of grants + bytes in flight <= usable (ledger I1), the settings the
replicas run never sum over usable, and a transfer is granted exactly once.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from gpubroker.broker import checkpoint as ckpt_mod
from gpubroker.broker.checkpoint import load_checkpoint
from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import StatsReport
from gpubroker.quotas.holding import holding_problems
from gpubroker.quotas.ledger import QuotaLedger
from tests.chaos.harness import FaultKind, Faults
from tests.chaos.tally import Tally

MIB = 1024**2

CONFIG = """
broker: {name: rel, namespace: rel, control_interval_s: 1.0, report_interval_s: 0.5, transfer_timeout_s: 60, metrics_port: 0}
gpu: {device: cpu, capacity: 384MiB, reserve_frac: 0.0, emergency_free_frac: 0.05}
models:
  hot:
    model: profiled
    options: {a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}
    quota: {min: 64MiB, base: 128MiB, max: 512MiB}
    batch: {floor: 2, ceiling: 64, initial: 4}
    slo_p95_ms: 1500
    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}
  cold:
    model: profiled
    options: {a_ms: 5, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 1048576}
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 16}
    slo_p95_ms: 1500
    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}
"""
USABLE = 384 * MIB
CAL = {"hot": (16 * MIB, 4 * MIB), "cold": (16 * MIB, 1 * MIB)}


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeFleet:
    """Replicas as far as the broker can tell: register, then one report each per step."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.seq = {"hot": 0, "cold": 0}
        self.running: dict[str, dict] = {}  # settings each replica runs (what it last got back)
        self.used: dict[str, int] = {}  # memory each replica holds now (what it last reported)

    def register(self, core: BrokerCore) -> None:
        for name, (w, per) in CAL.items():
            self.running[name] = core.register(
                name, f"{name}-r0", {"weights_bytes": w, "bytes_per_unit": per, "cost_unit": "requests"}
            ).to_dict()

    def report(self, core: BrokerCore) -> None:
        now = self.clock()
        for name in ("hot", "cold"):
            running = self.running[name]
            if name == "hot":  # busy: a backlog that would miss its SLO, full batches, 40 req/s
                body = dict(
                    arrivals=20,
                    completions=20,
                    latency_ms=tuple([200.0] * 20),
                    batches=tuple((float(running["max_batch_size"]), 22.0) for _ in range(5)),
                    batch_requests=tuple(running["max_batch_size"] for _ in range(5)),
                    busy_s=0.11,
                    queue_depth=2000,  # a backlog its grant cannot drain within the SLO: it borrows
                    mem_used_bytes=min(running["grant_bytes"], 100 * MIB),
                )
            else:  # idle and well under any grant it may be given
                body = dict(mem_used_bytes=20 * MIB)
            rep = {
                "model": name,
                "replica_id": f"{name}-r0",
                "seq": self.seq[name],
                "now_s": now,
                "interval_s": 0.5,
                "mem_peak_bytes": body.get("mem_used_bytes", 0),
                "settings_version": running["version"],
                **body,
            }
            self.seq[name] += 1
            self.used[name] = rep["mem_used_bytes"]
            self.running[name] = core.report(StatsReport.from_dict(rep)).to_dict()

    def running_sum(self) -> int:
        return sum(s["grant_bytes"] for s in self.running.values())


def ledger_of(core: BrokerCore) -> QuotaLedger:
    return core._state.ledger  # noqa: SLF001 - the broker's own ledger, compared with its checkpoint


def ckpt_ledger(path: Path) -> dict:
    return load_checkpoint(path).policy_state["ledger"]


def assert_invariants(core: BrokerCore, fleet: FakeFleet) -> None:
    led = ledger_of(core)
    led.check()  # I1..I4
    assert sum(led.grants.values()) + led.in_flight_bytes <= led.usable_bytes
    st = core.status()
    assert st["granted_bytes"] <= st["usable_bytes"]
    assert fleet.running_sum() <= USABLE, f"replicas run grants summing {fleet.running_sum()} > usable {USABLE}"
    assert not holding_problems(led, fleet.used)  # sum of max(grant + in flight, measured use) <= usable


def step(core: BrokerCore, fleet: FakeFleet, clock: Clock) -> None:
    clock.t += 0.5
    fleet.report(core)
    assert_invariants(core, fleet)
    clock.t += 0.5
    core.tick()
    assert_invariants(core, fleet)


def new_core(path: Path, clock: Clock) -> BrokerCore:
    return BrokerCore(CONFIG, capacity_bytes=384 * MIB, checkpoint=path, clock=clock)


def restart(path: Path, clock: Clock) -> BrokerCore:
    """Kill (drop every in-memory thing) and restart on the same checkpoint file."""
    saved = ckpt_ledger(path)
    core = new_core(path, clock)
    assert core.restored is True
    assert ledger_of(core).to_dict() == saved, "recovered ledger differs from the checkpoint"
    return core


def run_until(core, fleet, clock, pred, limit=80) -> int:
    for i in range(limit):
        if pred(core):
            return i
        step(core, fleet, clock)
    raise AssertionError(f"condition not reached in {limit} steps; ledger {ledger_of(core)!r}")


def pending(core) -> list:
    return list(ledger_of(core).pending)


def lent(core) -> bool:
    led = ledger_of(core)
    return not led.pending and led.grant("hot") > 128 * MIB


@pytest.fixture
def setup(tmp_path):
    clock = Clock()
    path = tmp_path / "ckpt.json"
    core = new_core(path, clock)
    fleet = FakeFleet(clock)
    fleet.register(core)
    return core, fleet, clock, path


def _finish_and_check_once(core, fleet, clock, path, phase: str, restarts: int) -> None:
    """After ``restarts`` kills (each restored from the checkpoint, checked in ``restart``), the
    lend completes exactly once and the grants stay within usable: each kill counts as survived
    only if that end state is observed."""
    run_until(core, fleet, clock, lent)
    led = ledger_of(core)
    hot, cold = led.grant("hot"), led.grant("cold")
    moves = [d for d in core.decisions() if d["kind"] == "move" and d["move"] in ("lend", "confirm")]
    lends = [d for d in moves if d["move"] == "lend"]
    confirms = [d for d in moves if d["move"] == "confirm"]
    # exactly one transfer's worth moved: hot gained what cold gave, never twice
    once = (
        hot - 128 * MIB == 256 * MIB - cold
        and sum(d["amount_bytes"] for d in confirms) == hot - 128 * MIB
        and len(confirms) == len(lends) >= 1
    )
    for _ in range(4):  # more ticks never grant it again
        step(core, fleet, clock)
    within = hot + cold <= USABLE and ledger_of(core).grant("hot") + ledger_of(core).grant("cold") <= USABLE
    faults = Faults("test_reliability_broker", f"broker killed {phase}", FaultKind.BROKER_RESTARTED)
    for i in range(restarts):
        faults.check(f"kill {i + 1}/{restarts}: ledger restored; lent once; grants <= usable", once and within)
    faults.record(  # the core on a fake clock: no request is sent
        Tally(), figure=f"hot {hot // MIB}MiB + cold {cold // MIB}MiB <= usable {USABLE // MIB}MiB; lent once"
    )
    assert not faults.failures(), (hot, cold, lends, confirms)


@pytest.mark.chaos
def test_kill_before_begin(setup):
    core, fleet, clock, path = setup
    for _ in range(2):
        step(core, fleet, clock)
    assert not pending(core) and ledger_of(core).grant("hot") == 128 * MIB
    core = restart(path, clock)  # killed with the reports in, before the tick that begins
    fleet.register(core)
    _finish_and_check_once(core, fleet, clock, path, "before begin", 1)


@pytest.mark.chaos
def test_kill_after_begin_before_confirm(setup):
    core, fleet, clock, path = setup
    run_until(core, fleet, clock, lambda c: pending(c))
    t = pending(core)[0]
    assert (t.donor, t.recipient) == ("cold", "hot")
    saved = ckpt_ledger(path)
    assert [p["id"] for p in saved["pending"]] == [t.id], "begin must be checkpointed before anyone acts on it"
    assert ledger_of(core).grant("hot") == 128 * MIB  # recipient not raised yet
    core = restart(path, clock)
    assert [p.id for p in pending(core)] == [t.id]
    assert ledger_of(core).grant("hot") == 128 * MIB
    # while the broker was down the replicas kept their last settings; cold's lowered grant is
    # the one in the table it will hand out again
    assert core.settings("cold").grant_bytes == ledger_of(core).grant("cold")
    fleet.register(core)
    _finish_and_check_once(core, fleet, clock, path, "after begin, before confirm", 1)


@pytest.mark.chaos
def test_kill_after_confirm(setup):
    core, fleet, clock, path = setup
    run_until(core, fleet, clock, lent)
    before = ledger_of(core).to_dict()
    core = restart(path, clock)
    assert ledger_of(core).to_dict() == before
    fleet.register(core)
    _finish_and_check_once(core, fleet, clock, path, "after confirm", 1)


@pytest.mark.chaos
def test_kill_in_every_phase_one_run(setup):
    """Kill after every single step of a whole lend; nothing is granted twice."""
    core, fleet, clock, path = setup
    restarts = 0
    for _ in range(40):
        step(core, fleet, clock)
        core = restart(path, clock)
        restarts += 1
        fleet.register(core)
        if lent(core):
            break
    _finish_and_check_once(core, fleet, clock, path, "after every step", restarts)


@pytest.mark.chaos
def test_checkpoint_write_cut_short_keeps_old_one(setup, monkeypatch):
    """A broker killed while writing its checkpoint leaves the previous checkpoint, intact."""
    core, fleet, clock, path = setup
    step(core, fleet, clock)
    good = path.read_text()
    real_replace = ckpt_mod.os.replace

    def die(src, dst):  # the process dies between writing the temp file and the rename
        raise KeyboardInterrupt("killed mid-checkpoint")

    monkeypatch.setattr(ckpt_mod.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        run_until(core, fleet, clock, lambda c: False, limit=40)
    monkeypatch.setattr(ckpt_mod.os, "replace", real_replace)
    assert path.read_text() == good
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")], "temp file left behind"
    core = restart(path, clock)
    fleet.register(core)
    _finish_and_check_once(core, fleet, clock, path, "mid-checkpoint write", 1)


def test_corrupt_checkpoint_starts_fresh(setup):
    core, fleet, clock, path = setup
    step(core, fleet, clock)
    path.write_text(path.read_text()[: len(path.read_text()) // 2])  # torn file (not our writer)
    core = new_core(path, clock)
    assert core.restored is False
    ledger_of(core).check()
    assert any("unreadable" in d.get("reason", "") for d in core.decisions())


# ------------------------------------------------------------------------------ bad configs
def _bad_configs(calibrated_weights: int) -> dict[str, tuple[str, str]]:
    """name -> (config text, a string the refusal must name)."""
    c = CONFIG
    return {
        "broken YAML": (c.replace("models:\n", "models:\n  - [\n", 1), "YAML"),
        "truncated file": (c[: c.index("  cold:") + 20], "cold"),
        "wrong type": (
            c.replace(
                "slo_p95_ms: 1500\n    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}\n  cold",
                "slo_p95_ms: fast\n    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}\n  cold",
            ),
            "models.hot.slo_p95_ms",
        ),
        "unknown key": (c.replace("    slo_p95_ms: 1500\n", "    slo_p95_ms: 1500\n    colour: red\n", 1), "colour"),
        "unknown model": (c + "  extra:\n    model: mlp\n    quota: {min: 0MiB, base: 0MiB, max: 1MiB}\n", "extra"),
        "negative size": (
            c.replace("quota: {min: 64MiB, base: 128MiB", "quota: {min: -64MiB, base: 128MiB"),
            "models.hot.quota.min",
        ),
        "sum of quotas over capacity": (
            c.replace("base: 128MiB, max: 512MiB", "base: 256MiB, max: 512MiB"),
            "quota.base",
        ),
        "quota under calibrated weights": (
            c.replace(
                "quota: {min: 64MiB, base: 256MiB, max: 256MiB}", "quota: {min: 8MiB, base: 256MiB, max: 256MiB}"
            ),
            "models.cold.quota.min",
        ),
        "overlapping windows": (
            c + "profiles:\n  schedule:\n"
            "    - {name: a, days: mon-fri, hours: '08:00-20:00'}\n"
            "    - {name: b, days: fri, hours: '19:00-22:00'}\n"
            "    - {name: off, default: true}\n",
            "profiles",
        ),
    }


@pytest.mark.chaos
def test_bad_configs_refused_with_field_hash_unchanged(setup):
    core, fleet, clock, path = setup
    step(core, fleet, clock)
    h0 = core.status()["config_hash"]
    fails0 = _reload_failures(core)
    bad = _bad_configs(16 * MIB)
    faults = Faults("test_reliability_broker", "bad configs via BrokerCore.apply", FaultKind.BAD_CONFIG)
    for what, (text, field) in bad.items():
        out = core.apply(text)
        named = any(field in issue for issue in out["issues"])
        step(core, fleet, clock)  # keeps running on the old config
        kept = core.status()["config_hash"] == h0 and json.loads(path.read_text())["config_hash"] == h0
        faults.check(f"{what}: refused naming {field!r}, hash kept", out["ok"] is False and named and kept)
    counted = None if fails0 is None else _reload_failures(core) - fails0
    faults.record(
        Tally(),  # configs, no request sent
        ok=counted in (None, len(bad)),
        figure=f"{len(bad) - len(faults.failures())}/{len(bad)} refused, field named, hash {h0} kept; "
        f"reload failures +{counted if counted is not None else '?'}",
    )
    assert not faults.failures(), faults.failures()
    assert counted in (None, len(bad)), counted


def _reload_failures(core) -> float | None:
    registry = getattr(getattr(core, "metrics", None), "registry", None)  # NullMetrics has none
    return None if registry is None else registry.get_sample_value("gpubroker_config_reload_failures_total")


def test_two_applies_from_threads_leave_one_consistent_result(setup):
    """Two applies from two threads, one after the other as the actor runs them (its ``apply``
    has no await inside, so they cannot interleave): the final hash is the last one and the
    checkpoint agrees with it. Not a chaos row: nothing here races."""
    core, fleet, clock, path = setup
    a = CONFIG.replace("slo_p95_ms: 1500", "slo_p95_ms: 1400", 1)
    b = CONFIG.replace("slo_p95_ms: 1500", "slo_p95_ms: 1300", 1)
    lock = threading.Lock()  # the actor runs one call at a time on its event loop
    results: dict[str, dict] = {}
    barrier = threading.Barrier(2)

    def go(name, text):
        barrier.wait()
        with lock:
            results[name] = core.apply(text)

    threads = [threading.Thread(target=go, args=(n, t)) for n, t in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hashes = {results["a"]["config_hash"], results["b"]["config_hash"]}
    final = core.status()["config_hash"]
    assert results["a"]["ok"] and results["b"]["ok"]
    assert final in hashes
    assert json.loads(path.read_text())["config_hash"] == final
    ledger_of(core).check()
