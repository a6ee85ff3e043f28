"""One broker for many cards (``gpubroker.broker.fleet_core.FleetBroker``): one core and ledger per card.

No Ray: a fake clock and synthetic replica reports (a stand-in for replicas, as in
``tests/unit/test_reliability_broker.py``). The same model placed on two cards has a grant on
each; a burst on one card borrows from that card's idle neighbour only; Σ grants ≤ usable per
card at every tick; a card whose replicas fall silent is lost and comes back when they report.
"""

from __future__ import annotations

from gpubroker.broker.fleet_core import DEAD_AFTER_S, FleetBroker
from gpubroker.broker.wire import StatsReport

MIB = 1024**2

CONFIG = """
broker: {name: fc, namespace: fc, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}
gpu: {reserve_frac: 0.0, emergency_free_frac: 0.05}
gpus:
  - {id: a0, node: node-a, index: 0, capacity: 384MiB, device: cpu}
  - {id: b0, node: node-b, index: 0, capacity: 384MiB, device: cpu}
models:
  hot:
    model: profiled
    options: {a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}
    quota: {min: 64MiB, base: 128MiB, max: 256MiB}
    batch: {floor: 2, ceiling: 64, initial: 4}
    slo_p95_ms: 1500
    replicas: 2
    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}
  cold:
    model: profiled
    options: {a_ms: 5, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 1048576}
    quota: {min: 64MiB, base: 200MiB, max: 200MiB}
    batch: {floor: 2, ceiling: 16}
    slo_p95_ms: 1500
    replicas: 2
    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}
"""
CAL = {"hot": (16 * MIB, 4 * MIB), "cold": (16 * MIB, 1 * MIB)}


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _fleet():
    clock = Clock()
    fb = FleetBroker(CONFIG, clock=clock)
    running: dict[tuple[str, str], dict] = {}
    seq: dict[tuple[str, str], int] = {}
    for model, cards in fb.placement.replicas.items():
        for cid in set(cards):
            w, per = CAL[model]
            running[(model, cid)] = fb.register(
                model, f"{model}@{cid}", {"weights_bytes": w, "bytes_per_unit": per, "cost_unit": "requests"}, cid
            ).to_dict()
            seq[(model, cid)] = 0
    return clock, fb, running, seq


def _report(fb, running, seq, clock, busy: set[tuple[str, str]], silent: frozenset[str] = frozenset()):
    for (model, cid), s in running.items():
        if cid in silent:
            continue
        if (model, cid) in busy:
            body = dict(
                arrivals=20,
                completions=20,
                latency_ms=tuple([200.0] * 20),
                batches=tuple((float(s["max_batch_size"]), 22.0) for _ in range(5)),
                batch_requests=tuple(s["max_batch_size"] for _ in range(5)),
                busy_s=0.11,
                queue_depth=4000,  # a backlog its grant cannot drain within the SLO: it borrows
                mem_used_bytes=min(s["grant_bytes"], 100 * MIB),
            )
        else:
            body = dict(mem_used_bytes=20 * MIB)
        rep = {
            "model": model,
            "replica_id": f"{model}@{cid}",
            "seq": seq[(model, cid)],
            "now_s": clock.t,
            "interval_s": 0.5,
            "mem_peak_bytes": body["mem_used_bytes"],
            "settings_version": s["version"],
            "card_id": cid,
            **body,
        }
        seq[(model, cid)] += 1
        running[(model, cid)] = fb.report(StatsReport.from_dict(rep)).to_dict()


def _per_card_ok(fb) -> None:
    st = fb.status()
    for card in st["cards"]:
        assert card["granted_bytes"] <= card["usable_bytes"], card
        assert sum(m["grant_bytes"] for m in card["models"].values()) == card["granted_bytes"]


def test_every_card_has_its_own_core_and_grants():
    _, fb, running, _ = _fleet()
    assert set(fb.cores) == {"a0", "b0"}
    assert fb.placement.replicas["hot"] == ("a0", "b0") or set(fb.placement.replicas["hot"]) == {"a0", "b0"}
    st = fb.status()
    assert [c["id"] for c in st["cards"]] == ["a0", "b0"]
    for card in st["cards"]:
        assert card["models"]["hot"]["grant_bytes"] == 128 * MIB  # the base, on every card it is on
        assert card["models"]["cold"]["grant_bytes"] == 200 * MIB
        assert card["capacity_bytes"] == 384 * MIB and card["usable_bytes"] == 384 * MIB
    assert st["models"]["hot"]["grant_bytes"] == 2 * 128 * MIB
    assert st["models"]["hot"]["cards"] == ["a0", "b0"]


def test_a_burst_on_one_card_borrows_only_on_that_card():
    clock, fb, running, seq = _fleet()
    for _ in range(30):
        clock.t += 0.5
        _report(fb, running, seq, clock, busy={("hot", "a0")})
        clock.t += 0.5
        fb.tick()
        _per_card_ok(fb)
    cards = {c["id"]: c for c in fb.status()["cards"]}
    assert cards["a0"]["models"]["hot"]["grant_bytes"] > 128 * MIB  # borrowed on a0
    assert cards["a0"]["models"]["cold"]["grant_bytes"] < 200 * MIB  # from a0's idle neighbour
    assert cards["b0"]["models"]["hot"]["grant_bytes"] == 128 * MIB  # b0 untouched
    assert cards["b0"]["models"]["cold"]["grant_bytes"] == 200 * MIB
    moves = [d for d in fb.decisions() if d["kind"] == "move"]
    assert moves and all(d["card"] == "a0" for d in moves)


def test_a_silent_card_is_lost_and_returns():
    clock, fb, running, seq = _fleet()
    for _ in range(int(DEAD_AFTER_S) + 5):
        clock.t += 0.5
        _report(fb, running, seq, clock, busy=set(), silent=frozenset({"b0"}))
        clock.t += 0.5
        fb.tick()
    st = fb.status()
    live = {c["id"]: c["live"] for c in st["cards"]}
    assert live == {"a0": True, "b0": False}
    assert st["granted_bytes"] == sum(c["granted_bytes"] for c in st["cards"] if c["id"] == "a0")
    assert any(d["kind"] == "card" and "lost" in d["reason"] for d in fb.decisions())
    _report(fb, running, seq, clock, busy=set())
    assert {c["id"]: c["live"] for c in fb.status()["cards"]} == {"a0": True, "b0": True}


def test_single_card_fleet_is_the_core_as_before():
    text = CONFIG.split("gpus:")[0].replace(
        "gpu: {reserve_frac: 0.0", "gpu: {device: cpu, capacity: 768MiB, reserve_frac: 0.0"
    )
    text += "models:" + CONFIG.split("models:")[1]
    fb = FleetBroker(text, clock=Clock())
    assert list(fb.cores) == ["card0"] and fb.single
    st = fb.status()
    assert st["cards"][0]["id"] == "card0" and st["models"]["hot"]["cards"] == ["card0"]
    assert st["models"]["hot"]["grant_bytes"] == 128 * MIB  # one grant for both replicas on the one card


def test_apply_that_moves_replicas_to_other_cards_is_refused_and_changes_nothing():
    _, fb, _, _ = _fleet()
    before = fb.config_hash
    out = fb.apply(
        CONFIG.replace(
            "replicas: 2\n    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}\n  cold",
            "replicas: 1\n    control: {window_s: 4, idle_hold_s: 2, reclaim_hold_s: 0.5, min_samples: 5}\n  cold",
        )
    )
    assert not out["ok"] and "gpubroker up" in out["issues"][0]
    assert fb.config_hash == before
    ok = fb.apply(CONFIG.replace("slo_p95_ms: 1500", "slo_p95_ms: 1200"))
    assert ok["ok"], ok
    assert all(core.config.models["hot"].slo_p95_ms == 1200 for core in fb.cores.values())


def test_status_table_groups_the_fleet_by_card():
    from rich.console import Console

    from gpubroker.cli.views import card_table

    _, fb, _, _ = _fleet()
    st = fb.status()
    console = Console(width=200, record=True)
    console.print(card_table(st))
    text = console.export_text()
    assert "a0" in text and "b0" in text and "hot 128.0MiB" in text
    one = dict(st, cards=st["cards"][:1])
    assert card_table(one) is None  # one card: the model table says it all


def test_a_one_card_fleet_keeps_ticking_when_its_replicas_fall_silent():
    text = CONFIG.split("gpus:")[0].replace(
        "gpu: {reserve_frac: 0.0", "gpu: {device: cpu, capacity: 768MiB, reserve_frac: 0.0"
    )
    text += "models:" + CONFIG.split("models:")[1]
    clock = Clock()
    fb = FleetBroker(text, clock=clock)
    fb.register("hot", "hot-r0", {"weights_bytes": 16 * MIB, "bytes_per_unit": 4 * MIB, "cost_unit": "requests"})
    for _ in range(int(DEAD_AFTER_S) + 5):
        clock.t += 1.0
        fb.tick()
    st = fb.status()
    assert st["cards"][0]["live"] and not fb.lost
    assert st["ticks"] == int(DEAD_AFTER_S) + 5
