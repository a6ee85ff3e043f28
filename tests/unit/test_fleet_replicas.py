"""Replica targets in the fleet broker (``FleetBroker.tick`` -> ``gpubroker.broker.control.replica_targets``), on a fake clock.

A model with 3 replicas on one card, the ``profiled`` latency model (a = 20 ms, c = 0.5 ms)
reported by synthetic replicas (as in ``tests/unit/test_fleet_core.py``). Off-peak (``latency``)
the target is the configured 3; when the schedule's ``peak`` window (``throughput``) opens, the
larger batches carry 60 req/s on one replica and the target drops after the hysteresis
(2 x window_s = 8 s); a load that one replica no longer carries raises it at once; the end of the
window restores 3. Every change is a ``kind: replicas`` decision with its rule, trigger and value.
"""

from __future__ import annotations

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.wire import StatsReport
from tests.unit.test_fleet_core import CONFIG as CARDS_CONFIG

TUE_0759_UTC = 1796111940.0  # Tuesday 1 December 2026, 07:59:00 UTC

CONFIG = """
broker: {name: fr, namespace: fr, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0}
models:
  hot:
    model: profiled
    options: {a_ms: 20, c_ms: 0.5, weights_bytes: 16777216, bytes_per_item: 4194304}
    quota: {min: 64MiB, base: 256MiB, max: 512MiB}
    batch: {floor: 2, ceiling: 64, initial: 8}
    slo_p95_ms: 1500
    replicas: 3
    control: {window_s: 4, min_samples: 5}
profiles:
  timezone: UTC
  schedule:
    - {name: peak, days: daily, hours: "08:00-20:00", price_per_gpu_hour: 3.5, objective: throughput, latency_slack: 1.2}
    - {name: offpeak, default: true, price_per_gpu_hour: 1.2, objective: latency}
"""


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Replicas:
    """Three replicas of ``hot`` that report every 0.5 s: ``rps`` requests per second in all."""

    def __init__(self, fb: FleetBroker, clock: Clock):
        self.fb, self.clock, self.seq = fb, clock, 0
        self.settings = {f"hot-{i}": fb.register("hot", f"hot-{i}", None).version for i in range(3)}

    def second(self, rps: float) -> dict:
        for _ in range(2):
            self.clock.t += 0.5
            per = int(round(rps * 0.5 / 3))
            for rid, s in self.settings.items():
                body = {}
                if per:
                    body = dict(
                        arrivals=per,
                        completions=per,
                        latency_ms=tuple([40.0] * min(per, 20)),
                        batches=tuple((float(b), 20.0 + 0.5 * b) for b in (2, 4, 8)),
                        batch_requests=(2, 4, 8),
                        busy_s=0.05,
                        queue_depth=1,
                    )
                self.settings[rid] = self.fb.report(
                    StatsReport.from_dict(
                        {
                            "model": "hot",
                            "replica_id": rid,
                            "seq": self.seq,
                            "now_s": self.clock.t,
                            "interval_s": 0.5,
                            "mem_used_bytes": 40 * 1024**2,
                            "mem_peak_bytes": 40 * 1024**2,
                            "settings_version": s,
                            **body,
                        }
                    )
                ).version
            self.seq += 1
        return self.fb.tick()


def _replica_entries(fb: FleetBroker) -> list[dict]:
    return [e for e in fb.decisions("hot") if e["kind"] == "replicas"]


def test_targets_follow_the_schedule_and_the_load():
    clock = Clock(TUE_0759_UTC)
    fb = FleetBroker(CONFIG, clock=clock)
    reps = Replicas(fb, clock)
    assert fb.status()["models"]["hot"]["replica_target"] == 3  # before any tick: the configured count

    for _ in range(50):  # off-peak (07:59:00-07:59:50): latency objective, the configured 3
        reps.second(60.0)
    st = fb.status()
    assert st["profile"] == "offpeak" and st["models"]["hot"]["replica_target"] == 3
    assert _replica_entries(fb) == []

    ticks_to_lower = 0
    while fb.status()["models"]["hot"]["replica_target"] == 3:  # peak opens at 08:00:00
        reps.second(60.0)
        ticks_to_lower += 1
        assert ticks_to_lower < 40, "the target never dropped under the throughput profile"
    st = fb.status()
    assert st["profile"] == "peak"
    assert clock.t >= TUE_0759_UTC + 60 + 8  # not before the peak window plus the 8 s hysteresis
    [lower] = _replica_entries(fb)
    assert lower["rule"] == "replicas_lower" and lower["trigger"] == "arrival_rate_rps"
    assert lower["old"] == {"replica_target": 3} and lower["new"] == {"replica_target": 1}
    assert 50 <= lower["trigger_value"] <= 70 and lower["inputs"]["objective"] == "throughput"
    assert lower["inputs"]["replicas"] == 3 and lower["inputs"]["a_ms"] is not None
    assert "card" not in lower  # a one-card fleet's entries name no card
    assert st["models"]["hot"]["replica_target"] == 1 and st["cards"][0]["models"]["hot"]["replica_target"] == 1
    assert st["models"]["hot"]["replicas"] == 3  # the fake replicas still report: the broker only sets the target

    for _ in range(10):  # steady load: it holds (no flapping)
        reps.second(60.0)
    assert len(_replica_entries(fb)) == 1

    for _ in range(15):  # 2400 req/s: one replica at cap 64 carries ~860 req/s at utilisation 0.7
        reps.second(2400.0)
        if fb.status()["models"]["hot"]["replica_target"] > 1:
            break
    raised = _replica_entries(fb)[-1]
    assert raised["rule"] == "replicas_raise" and raised["new"]["replica_target"] > 1

    clock.t = TUE_0759_UTC + 12 * 3600 + 60  # 20:00: the peak window ends
    reps.second(60.0)
    st = fb.status()
    back = _replica_entries(fb)[-1]
    assert st["profile"] == "offpeak" and st["models"]["hot"]["replica_target"] == 3
    if raised["new"]["replica_target"] < 3:  # raised to 2 by the load: the profile change restores 3
        assert back["rule"] == "replicas_configured" and back["trigger"] == "objective"
        assert back["new"] == {"replica_target": 3}
    seqs = [e["seq"] for e in _replica_entries(fb)]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_many_cards_show_a_target_and_a_cost_per_card():
    clock = Clock(1_000_000.0)
    fb = FleetBroker(CARDS_CONFIG, clock=clock)
    for model, cards in fb.placement.replicas.items():
        for cid in set(cards):
            fb.register(model, f"{model}@{cid}", None, cid)
    fb.tick()
    st = fb.status()
    for card in st["cards"]:
        for name, m in card["models"].items():
            assert m["replica_target"] == fb.cores[card["id"]].config.models[name].replicas  # this card's count
            assert "cost_per_1k_requests" in m
    for name, m in st["models"].items():
        assert m["replica_target"] == sum(c["models"][name]["replica_target"] for c in st["cards"])
        assert m["replica_target"] == fb.config.models[name].replicas  # default profile balanced: configured


def test_the_status_tables_and_the_log_line_show_the_target():
    from rich.console import Console

    from gpubroker.cli.views import card_table, describe_decision, status_table

    clock = Clock(TUE_0759_UTC + 61)  # in the peak window
    fb = FleetBroker(CONFIG, clock=clock)
    reps = Replicas(fb, clock)
    for _ in range(12):
        reps.second(60.0)
    st = fb.status()
    console = Console(width=200, record=True)
    console.print(status_table(st))
    text = console.export_text()
    assert "target" in text and st["models"]["hot"]["replica_target"] == 1
    assert "3 -> 1" in text  # hot's live replicas and the target the broker set
    [entry] = _replica_entries(fb)
    line = describe_decision(entry)
    assert "hot: replicas 3->1" in line and "[arrival_rate_rps=" in line and "replicas_" not in line.split("]")[0]

    fb2 = FleetBroker(CARDS_CONFIG, clock=Clock(1_000_000.0))
    fb2.tick()
    console = Console(width=240, record=True)
    console.print(card_table(fb2.status()))
    text = console.export_text()
    assert "(replicas, target)" in text and "hot 128.0MiB / 0B (0, 1)" in text  # none live yet, target 1 per card
