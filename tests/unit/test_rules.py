"""Every batch rule and every strategy, through ``BrokerCore`` with a latency fit present.

A fake replica reports to the core on a fake clock (integer half-second steps) with batch
timings of L(b) = 20 + 0.5 b ms, so the policy has its latency fit from the first tick; each
test shapes the load so that one rule's condition holds and reads the decision log (its
``rule`` and ``trigger``) or the settings the replica would get back. The table in
docs/RULES.md is checked against ``gpubroker.broker.control.batch_rules.RULES`` at the end.

With L(b) = 20 + 0.5 b, SLO 100 ms and the default (balanced) objective, the plan's cap is
b_lat = 60 (the largest batch with 2 L(b) <= SLO) at any rate up to a few hundred per second.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpubroker.broker.control.batch_rules import RULE_SETS, RULES, rule_name
from gpubroker.broker.control.vocab import Rule, Trigger
from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import ModelSettings, StatsReport

GiB = 1024**3
MONDAY_NOON_UTC = 1_795_996_800.0 + 12 * 3600
SIZES = (2, 4, 8, 16, 32)  # batch sizes the fake replica reports (distinct: the slope is identified)
PLAN_CAP = 60  # b_lat for L(b) = 20 + 0.5 b under SLO 100 ms

CONFIG = """
broker: {{control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0, batch_formation: {formation}}}
gpu: {{device: cpu, capacity: 10GiB, reserve_frac: 0.1, emergency_free_frac: 0.10}}
models:
  m:
    model: profiled
    quota: {{min: 1GiB, base: 3GiB, max: 6GiB}}
    batch: {{floor: 2, ceiling: 128, initial: {initial}}}
    wait: {{initial_ms: {wait_ms}}}  # 0: the lazy plan's wait at these loads: only the cap moves
    slo_p95_ms: {slo}
    control: {{strategy: {strategy}, min_samples: 20, idle_hold_s: 5}}
"""


class HalfSteps:
    """Fake clock in integer half-second steps (float steps drift, integers do not)."""

    def __init__(self) -> None:
        self.steps = 0

    def __call__(self) -> float:
        return MONDAY_NOON_UTC + self.steps * 0.5


@dataclass(frozen=True)
class Load:
    """What the fake replica reports every half second."""

    rate_rps: float = 100.0
    queue: int = 10  # queue depth (waiting or running)
    latency_ms: tuple[float, ...] = (30.0,)  # cycled over the completions
    fit: bool = True  # report batch timings (L(b) = fit_a_ms + 0.5 b)
    fit_a_ms: float = 20.0
    sm: float | None = None  # SM utilisation
    mem_used_bytes: int = 1 * GiB
    emergency_shrinks: int = 0
    sizes: tuple[int, ...] = SIZES  # the batch sizes reported each half second (their mean is the window's batch)


def spread(lo: float, hi: float, n: int = 20) -> tuple[float, ...]:
    """n latencies evenly from lo to hi (the P95 is near hi)."""
    return tuple(lo + (hi - lo) * k / (n - 1) for k in range(n))


class Fleet:
    """One fake replica of model ``m`` reporting to a BrokerCore; the core ticks every second."""

    def __init__(
        self,
        strategy: str = "hybrid",
        initial: int = 8,
        slo: float = 100.0,
        formation: str = "lazy",
        wait_ms: float = 0,
    ) -> None:
        self.clock = HalfSteps()
        config = CONFIG.format(strategy=strategy, initial=initial, slo=slo, formation=formation, wait_ms=wait_ms)
        self.core = BrokerCore(config, clock=self.clock)
        self.seq = 0
        self.sample = 0

    def _report(self, load: Load) -> StatsReport:
        n = int(load.rate_rps * 0.5)
        lat = tuple(load.latency_ms[(self.sample + k) % len(load.latency_ms)] for k in range(n))
        self.sample += n
        batches = tuple((float(b), load.fit_a_ms + 0.5 * b) for b in load.sizes) if load.fit else ()
        rep = StatsReport(
            model="m",
            replica_id="r0",
            seq=self.seq,
            now_s=self.clock(),
            interval_s=0.5,
            arrivals=n,
            completions=n,
            latency_ms=lat,
            batches=batches,
            batch_requests=tuple(int(b) for b, _ in batches),
            busy_s=min(0.5, sum(ms for _, ms in batches) / 1000.0),
            queue_depth=load.queue,
            mem_used_bytes=load.mem_used_bytes,
            mem_peak_bytes=load.mem_used_bytes,
            sm_util_frac=load.sm,
            emergency_shrinks=load.emergency_shrinks,
            settings_version=self.settings().version,
        )
        self.seq += 1
        return rep

    def run(self, seconds: int, load: Load) -> list[dict[str, Any]]:
        """Report every half second, tick every second; the settings entries logged meanwhile."""
        since = self.core.status()["decision_seq"]
        for _ in range(seconds):
            for _ in range(2):
                self.clock.steps += 1
                self.core.report(self._report(load))
            self.core.tick()
        return [e for e in self.core.decisions("m", since) if e["kind"] == "settings"]

    def settings(self) -> ModelSettings:
        return self.core.settings("m")

    def cap(self) -> int:
        return self.settings().max_batch_size


def only(entries: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(entries) == 1, entries
    return entries[0]


# ------------------------------------------------------------------------------ rules (hybrid)
def test_model_rule_plans_the_cap_from_the_fit():
    f = Fleet()
    e = only(f.run(1, Load()))
    assert (e["rule"], e["trigger"]) == (Rule.MODEL, Trigger.ARRIVAL_RATE_RPS)
    assert f.cap() == PLAN_CAP
    assert "L(b)=20.0+0.500b" in e["reason"]


def test_hold_inside_the_model_dead_band():
    f = Fleet()
    f.run(1, Load())
    assert f.run(3, Load()) == []  # the plan's cap is the cap: nothing to log
    assert f.cap() == PLAN_CAP


@pytest.mark.parametrize("formation", ["eager", "lazy"])
def test_a_cap_the_grant_pins_keeps_its_wait_inside_the_dead_band(formation):
    """The plan wants about 60 but the grant holds a batch of 20 (no lending: max = base). The
    batch timings wiggle (L(b) = 17..23 + 0.5 b): the plan's wait moves 1-4 %, inside its 20 %
    band, so the settings stay as they are. (The model rule used to read the pinned cap's 60 vs
    20 as a move and push every wiggle of the wait: a new settings version a tick.) Timings that
    double L(b)'s intercept move the wait past the band, and that is pushed, once."""
    f = Fleet(formation=formation)
    assert f.core.apply(f.core._config_text.replace("max: 6GiB", "max: 3GiB"))["ok"]  # noqa: SLF001
    # grant 3 GiB x 0.9 headroom - 1 GiB of weights = 1.7 GiB: 20 batch units
    f.core.register("m", "r0", {"weights_bytes": GiB, "bytes_per_unit": 1.7 * GiB / 20.5})
    f.run(3, Load())
    first = f.settings()
    assert first.max_batch_size == 20 and first.batch_wait_timeout_s > 0
    wiggle = [e for a in (22.0, 18.0, 23.0, 17.0, 20.0, 21.0, 19.0) for e in f.run(1, Load(fit_a_ms=a))]
    assert wiggle == [] and f.settings().version == first.version
    moved = only(f.run(3, Load(fit_a_ms=40.0)))
    assert moved["rule"] == Rule.MODEL and f.cap() == 20
    assert abs(f.settings().batch_wait_timeout_s / first.batch_wait_timeout_s - 1) > 0.2


def test_emergency_halves_with_a_fit():
    f = Fleet(initial=64)
    hot = Load(mem_used_bytes=int(9.5 * GiB), queue=300)  # free 5% < 10%; half the queue is over half the cap
    f.run(1, hot)  # (on cpu the core takes the pool's used memory from the previous tick's snapshot)
    cap = f.cap()
    e = only(f.run(1, hot))
    assert (e["rule"], e["trigger"]) == (Rule.EMERGENCY, Trigger.FREE_FRAC)
    assert f.cap() == cap // 2


def test_emergency_from_the_replicas_fast_loop():
    f = Fleet(initial=64)
    e = f.run(1, Load(emergency_shrinks=1, queue=100))[0]
    assert e["rule"] == Rule.EMERGENCY and "replica reported an emergency shrink" in e["reason"]
    assert f.cap() == 32


def test_p95_queueing_grows_to_the_plan_under_a_backlog():
    f = Fleet()
    e = only(f.run(1, Load(queue=40, latency_ms=spread(60, 99))))
    assert (e["rule"], e["trigger"]) == (Rule.P95_QUEUEING, Trigger.P95_MS)
    assert f.cap() == PLAN_CAP


def test_p95_high_shrinks_a_cap_above_the_plan():
    f = Fleet(initial=128)
    e = only(f.run(1, Load(queue=2, latency_ms=spread(60, 99))))
    assert (e["rule"], e["trigger"]) == (Rule.P95_HIGH, Trigger.P95_MS)
    assert f.cap() == PLAN_CAP  # x0.7 = 89, then b_lat: 60


def test_idle_goes_to_the_floor_with_a_fit():
    f = Fleet(formation="eager")
    f.run(2, Load())
    entries = f.run(12, Load(rate_rps=0.0, queue=0))  # the rate window (5 s) empties, then idle_hold_s (5 s)
    assert [e for e in entries if e["rule"] == Rule.IDLE]
    assert f.cap() == 2


def test_idle_holds_the_cap_with_lazy_formation():
    """Lazy batches size themselves: an idle model keeps its cap for the next burst (its memory
    use, not its cap, decides what it lends)."""
    f = Fleet(formation="lazy")
    f.run(2, Load())
    before = f.cap()
    f.run(12, Load(rate_rps=0.0, queue=0))
    assert f.cap() == before > 2


def test_sm_busy_holds_the_plans_growth_while_p95_rises():
    # 24 s of flat 20 ms latencies and no timings (no fit yet: queue in band, card busy: hold),
    # then 5 s of 50-80 ms: the recent P95 (~78) is over the window's (~70) but under 0.9 x SLO
    rising, flat = Fleet(), Fleet()
    for f in (rising, flat):
        assert f.run(24, Load(fit=False, sm=0.99, latency_ms=(20.0,))) == []
    rising.run(5, Load(fit=False, sm=0.99, latency_ms=spread(50, 80)))
    flat.run(5, Load(fit=False, sm=0.99, latency_ms=(20.0,)))
    assert rising.run(1, Load(sm=0.99, latency_ms=spread(50, 80))) == []  # the fit arrives; the plan wants 60
    assert rising.cap() == 8
    e = only(flat.run(1, Load(sm=0.99, latency_ms=(20.0,))))  # P95 flat: the plan grows
    assert e["rule"] == Rule.MODEL and flat.cap() == PLAN_CAP


def test_queue_high_grows_past_the_plan_when_the_queue_outruns_its_cap():
    f = Fleet(initial=64)  # the plan wants 60; 100 queued is more than that
    e = only(f.run(1, Load(queue=100)))
    assert (e["rule"], e["trigger"]) == (Rule.QUEUE_HIGH, Trigger.QUEUE_DEPTH)
    assert f.cap() == 128


def test_queue_low_shrinks_to_the_plan_inside_its_dead_band():
    f = Fleet(initial=64)  # 64 -> 60 is inside the model rule's 10% dead band
    e = only(f.run(1, Load(queue=2)))
    assert (e["rule"], e["trigger"]) == (Rule.QUEUE_LOW, Trigger.QUEUE_DEPTH)
    assert f.cap() == PLAN_CAP


def test_sm_low_grows_when_the_card_idles_with_work_waiting():
    # SLO 50: the plan's cap is b_lat = 10; 12 queued is more than it takes, the card is at 20%
    f = Fleet(initial=10, slo=50)
    e = only(f.run(1, Load(queue=12, sm=0.2, latency_ms=spread(30, 40))))
    assert (e["rule"], e["trigger"]) == (Rule.SM_LOW, Trigger.SM_UTIL_FRAC)
    assert f.cap() == 12


def test_p95_low_grows_by_a_step_with_work_waiting():
    f = Fleet(initial=10, slo=50)
    e = only(f.run(1, Load(queue=12, latency_ms=spread(15, 25))))  # P95 25 < 0.6 x 50
    assert (e["rule"], e["trigger"]) == (Rule.P95_LOW, Trigger.P95_MS)
    assert f.cap() == 12


def QUIET(rate_rps: float, sizes: tuple[int, ...] = (1, 1, 1, 2)) -> Load:  # noqa: N802 - a Load preset
    """An empty queue and batches of mostly one request (a mean of 1.25: two sizes for the fit)."""
    return Load(rate_rps=rate_rps, queue=0, sizes=sizes)


def test_low_load_keeps_the_wait_where_batches_show_requests_come_together():
    """2 req/s on average, but the window's batches hold 5 requests: the arrivals come in clumps
    and a wait gathers them (the mean rate would say 0.1 arrivals in 50 ms): no floor."""
    f = Fleet(slo=400, wait_ms=10)
    entries = f.run(3, QUIET(rate_rps=2.0, sizes=(4, 6)))
    assert all(e["rule"] != Rule.LOW_LOAD for e in entries)
    assert f.settings().batch_wait_timeout_s == pytest.approx(0.050)


def test_low_load_takes_the_wait_to_the_floor_when_it_gathers_nothing():
    """SLO 400 ms: the lazy plan's wait is wait.max_ms (50 ms), so 2 req/s expect 0.1 arrivals
    in it: the wait goes to wait.min_ms (0) at once, and the log says why."""
    f = Fleet(slo=400, wait_ms=10)
    e = only(f.run(1, QUIET(rate_rps=2.0)))
    assert (e["rule"], e["trigger"]) == (Rule.LOW_LOAD, Trigger.ARRIVAL_RATE_RPS)
    assert "arrivals expected in a 50.0 ms wait" in e["reason"] and "wait 10.0->0.0 ms" in e["reason"]
    assert f.settings().batch_wait_timeout_s == 0.0
    assert f.run(3, QUIET(rate_rps=2.0)) == []  # at the floor it stays: nothing to log


def test_low_load_floor_has_a_hysteresis_band():
    """Entered under 1 expected arrival, left at 2: with the 50 ms wait, 30 req/s (1.5 arrivals)
    keeps the wait where it is, at the floor or at the plan, tick after tick."""
    f = Fleet(slo=400, wait_ms=10)
    f.run(1, QUIET(rate_rps=2.0))
    assert f.settings().batch_wait_timeout_s == 0.0
    f.run(40, QUIET(rate_rps=30.0))  # the window fills with 30/s: 1.5 arrivals, in the band
    assert f.settings().batch_wait_timeout_s == 0.0  # the floor holds
    left = [e for e in f.run(10, QUIET(rate_rps=60.0)) if e["new"]["batch_wait_timeout_s"] > 0]  # 3: off it
    assert left and left[0]["rule"] == Rule.MODEL and "off the low-load floor" in left[0]["reason"]
    assert f.settings().batch_wait_timeout_s == pytest.approx(0.050)
    f.run(40, QUIET(rate_rps=30.0))  # back in the band: the plan's wait holds
    assert f.settings().batch_wait_timeout_s == pytest.approx(0.050)
    back = [e for e in f.run(40, QUIET(rate_rps=10.0)) if e["rule"] == Rule.LOW_LOAD]  # 0.5: the floor
    assert len(back) == 1 and f.settings().batch_wait_timeout_s == 0.0


def test_low_load_leaves_a_busy_model_its_wait():
    """At 400 req/s (20 arrivals in the wait) the plan keeps its wait: the rule never fires."""
    f = Fleet(slo=400, wait_ms=10)
    entries = f.run(3, QUIET(rate_rps=400.0))
    assert entries and all(e["rule"] != Rule.LOW_LOAD for e in entries)
    assert f.settings().batch_wait_timeout_s == pytest.approx(0.050)


# ------------------------------------------------------------------------------ strategies
def test_hybrid_is_the_plan_guarded():
    f = Fleet()
    assert only(f.run(1, Load()))["rule"] == Rule.MODEL  # the plan drives
    e = only(f.run(1, Load(queue=100)))  # a queue the plan's cap does not take: the band's top acts
    assert e["rule"] == Rule.QUEUE_HIGH and f.cap() == 120


def test_queue_strategy_runs_the_dead_band_without_the_model():
    f = Fleet(strategy="queue")
    e = only(f.run(1, Load(queue=40)))  # above the top: x min(2, 40/10)
    assert e["rule"] == Rule.QUEUE_HIGH and f.cap() == 16
    assert f.run(2, Load(queue=10)) == []  # inside: hold
    e = only(f.run(1, Load(queue=2, latency_ms=spread(20, 30))))  # below the bottom: x max(1/2, 2/10)
    assert e["rule"] == Rule.QUEUE_LOW and f.cap() == 8


def test_aimd_strategy_runs_on_p95_without_the_model():
    f = Fleet(strategy="aimd")
    e = only(f.run(1, Load(queue=3, latency_ms=spread(20, 40))))  # well under with work waiting: +2
    assert e["rule"] == Rule.P95_LOW and f.cap() == 10
    e = only(f.run(1, Load(queue=3, latency_ms=spread(60, 99))))  # near the SLO, no backlog: x0.7
    assert e["rule"] == Rule.P95_HIGH and f.cap() == 7


def test_model_strategy_follows_the_plan_alone():
    f = Fleet(strategy="model")
    e = only(f.run(1, Load(queue=40, latency_ms=spread(60, 99))))  # hybrid would answer with p95_queueing
    assert (e["rule"], e["trigger"]) == (Rule.MODEL, Trigger.ARRIVAL_RATE_RPS)
    assert f.cap() == PLAN_CAP
    assert f.run(2, Load(queue=100, sm=0.2)) == []  # no guards: the plan holds


def test_static_strategy_never_moves():
    f = Fleet(strategy="static")
    assert f.run(3, Load(queue=100, latency_ms=spread(60, 99), sm=0.2)) == []
    assert f.cap() == 8


def test_every_rule_set_ends_with_a_rule_that_always_answers():
    for strategy, rules in RULE_SETS.items():
        assert rule_name(rules[-1]) in (Rule.HOLD, Rule.STATIC), strategy
        order = [RULES.index(r) for r in rules]
        assert order == sorted(order), f"{strategy} keeps the table's precedence"


# ------------------------------------------------------------------------------ the doc's table
DOC = Path(__file__).resolve().parents[2] / "docs" / "RULES.md"


def _doc_rows() -> list[tuple[str, set[str]]]:
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `(\w+)` \| ([^|]+) \|", line)
        if m:
            rows.append((m.group(1), {s.strip() for s in m.group(2).split(",")}))
    return rows


def test_rules_doc_lists_exactly_the_code_rules_in_order():
    rows = _doc_rows()
    assert [name for name, _ in rows] == [rule_name(r) for r in RULES]
    for name, strategies in rows:
        in_code = {s for s, rules in RULE_SETS.items() if any(rule_name(r) == name for r in rules)}
        assert strategies == in_code, f"docs/RULES.md row {name}: {sorted(strategies)} vs code {sorted(in_code)}"


@pytest.mark.parametrize("value", list(Rule) + list(Trigger))
def test_vocabulary_serialises_as_plain_strings(value):
    import json

    assert json.loads(json.dumps({"v": value}))["v"] == value.value == f"{value}"


def test_status_and_log_keep_their_strings():
    f = Fleet()
    e = only(f.run(1, Load()))
    assert {"kind": "settings", "trigger": "arrival_rate_rps", "rule": "model"}.items() <= e.items()
