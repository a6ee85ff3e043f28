"""The broker arm of the simulator: the live ``FleetBroker`` on the virtual clock.

The simulator does not wire the policy itself: it drives the object the Ray actor wraps, on a
clock that reads virtual time, exactly as replicas do: each emulated replica registers once with
its calibration, sends one ``StatsReport`` every ``report_interval_s`` and applies the settings in
the reply; every ``control_interval_s`` the simulator ticks. So the report window, ``decide``,
the settings table, the replica targets and the decision log are the live ones; metrics and
checkpoints are off (they observe the broker, they do not steer it). ``trace`` records every
call in order, so a test can replay it into a second broker and compare decisions.
"""

from __future__ import annotations

from typing import Any

from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.broker.metrics import NullMetrics
from gpubroker.broker.wire import Calibration, ModelSettings, StatsReport
from gpubroker.quotas.config import FleetConfig
from gpubroker.sim.types import LATENCY_SAMPLES_PER_REPORT, SimReplica


class SimBroker:
    """The simulator's side of the report/reply path."""

    def __init__(
        self,
        sim: Any,
        *,
        record: bool = False,
        fleet: FleetConfig | None = None,
        card: str = "",
        lost_at_s: float | None = None,
    ) -> None:
        """``sim``: the ``gpubroker.sim.engine.Simulator`` (not imported: no cycle). ``fleet`` and
        ``card``: the simulator runs ``card`` of a many-card ``fleet`` (``gpubroker.quotas.card_fleet``), and the
        broker is the whole fleet's, with re-placement on; from ``lost_at_s`` (virtual seconds) the
        card's reports no longer arrive, as when its node is gone."""
        self.sim = sim
        clock = lambda: sim.epoch0 + sim.now  # noqa: E731
        if fleet is None:
            self.broker = FleetBroker(sim.config, capacity_bytes=sim.capacity, clock=clock, metrics=NullMetrics())
        else:
            self.broker = FleetBroker(fleet, clock=clock, metrics=NullMetrics())
            self.broker.enable_replacement()
        self.card, self.lost_at_s = card, lost_at_s
        self._last: dict[str, ModelSettings] = {}  # replica -> the settings it runs (kept while its reports are lost)
        self.trace: list[tuple[str, float, Any]] | None = [] if record else None
        self._seen_seq = 0

    def calibration(self, rep: SimReplica) -> Calibration:
        p = rep.prof
        return {"weights_bytes": int(p.weights_bytes), "bytes_per_unit": float(p.bytes_per_item), "cost_unit": p.unit}

    def register(self, rep: SimReplica) -> ModelSettings:
        cal = self.calibration(rep)
        if self.trace is not None:
            self.trace.append(("register", self.sim.epoch0 + self.sim.now, (rep.name, rep.rid, cal)))
        got = self._last[rep.rid] = self.broker.register(rep.name, rep.rid, cal, self.card)
        return got

    def report(self, rep: SimReplica) -> ModelSettings:
        """Build the replica's delta since its last report, send it, return the reply."""
        sim = self.sim
        sim._gpu_advance()
        now = sim.now
        interval = now - rep.last_report_t
        card_share = (sim.card_busy - rep.card_busy_mark) / interval if interval > 0 else 0.0
        lat = rep.st_lat
        if len(lat) > LATENCY_SAMPLES_PER_REPORT:
            step = len(lat) / LATENCY_SAMPLES_PER_REPORT
            lat = [lat[int(k * step)] for k in range(LATENCY_SAMPLES_PER_REPORT)]
        used = sim.mem_pool.total
        report = StatsReport(
            model=rep.name,
            replica_id=rep.rid,
            seq=rep.seq,
            now_s=sim.epoch0 + now,
            interval_s=interval,
            arrivals=rep.st_arr,
            completions=rep.st_done,
            rejections=rep.st_rej,
            timeouts=rep.st_to,
            errors=rep.st_err,
            latency_ms=tuple(lat),
            batches=tuple(rep.st_batches),
            batch_requests=tuple(rep.st_breq),
            busy_s=rep.busy_acc,
            queue_depth=sim.held_requests(rep),
            mem_used_bytes=int(rep.mem_now),
            mem_peak_bytes=int(rep.st_peak),
            device_free_frac=max(0.0, 1.0 - used / sim.capacity),
            sm_util_frac=min(1.0, card_share),
            oom_splits=rep.st_oom,
            oom_costs=tuple(rep.st_oom_costs),
            emergency_shrinks=rep.st_emerg,
            shed=rep.st_shed,
            settings_version=max(0, rep.version),
            card_id=self.card,
        )
        rep.seq += 1
        rep.last_report_t = now
        rep.card_busy_mark = sim.card_busy
        rep.busy_acc = 0.0
        rep._reset_stats()
        if self.lost_at_s is not None and now >= self.lost_at_s:
            return self._last[rep.rid]  # the node is gone: the report never arrives
        if self.trace is not None:
            self.trace.append(("report", sim.epoch0 + now, report))
        got = self._last[rep.rid] = self.broker.report(report)
        return got

    def tick(self) -> None:
        if self.trace is not None:
            self.trace.append(("tick", self.sim.epoch0 + self.sim.now, None))
        self.broker.tick()
        self._collect()

    def _collect(self) -> None:
        """The decision log's new entries, in the simulator's compact form."""
        sim = self.sim
        new = self.broker.decisions(since_seq=self._seen_seq)
        if new:
            self._seen_seq = new[-1]["seq"]
        t = round(sim.now, 3)
        for e in new:
            if len(sim.decisions) >= sim.keep_decisions:
                return
            n = e.get("new")
            if e["kind"] == "settings" and n is not None:  # a settings entry always says what it set
                sim.decisions.append(
                    {
                        "t": t,
                        "model": e["model"],
                        "max_batch": n["max_batch_size"],
                        "wait_ms": round(n["batch_wait_timeout_s"] * 1000, 3),
                        "grant_bytes": n["grant_bytes"],
                        "admit": n["admit"],
                        "trigger": e["trigger"],
                        "value": e["trigger_value"],
                        "reason": e["reason"],
                    }
                )
            elif e["kind"] == "move":
                sim.decisions.append(
                    {
                        "t": t,
                        "move": e["move"],
                        "donor": e["donor"],
                        "recipient": e["recipient"],
                        "amount_bytes": e["amount_bytes"],
                        "reason": e["reason"],
                    }
                )
