"""The replica's link to the broker: stats deltas, one report per interval, retry.

A replica sends one ``StatsReport`` delta per report interval and gets its ``ModelSettings``
back in the same round trip; the broker never calls a replica. ``StatsDelta`` keeps the counters
since the last report that reached the broker: a report that fails before it was sent is merged
into the next delta (nothing lost); one that timed out may still land (the actor retries tasks
across restarts) and is not resent (nothing counted twice). The broker's actor handle
(``get_handle``, wrapped in a ``gpubroker.broker.client.BrokerClient``: wire types both ways) and the
clock are injected.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpubroker.broker.client import BrokerClient
from gpubroker.broker.wire import Calibration, EngineReport, ModelSettings, StatsReport

logger = logging.getLogger("ray.serve")

MAX_LATENCY_SAMPLES = 2000  # per report; a uniform sample beyond that
MERGED_BATCHES_KEPT = 512  # batch timings kept when an unsent delta is merged


@dataclass
class StatsDelta:
    """Counters since the last report that reached the broker."""

    started_s: float
    arrivals: int = 0
    completions: int = 0
    rejections: int = 0
    timeouts: int = 0
    errors: int = 0
    latency_ms: list[float] = field(default_factory=list)
    latency_seen: int = 0
    batches: list[tuple[float, float]] = field(default_factory=list)
    batch_requests: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    mem_peak_bytes: int = 0
    oom_splits: int = 0
    emergency_shrinks: int = 0
    held_refusals: int = 0  # requests refused: the replica holds over its grant (gpubroker.deployments.enforce.limits)
    shed: int = 0  # requests answered 504 at the gate: too late for the SLO (gpubroker.deployments.replica.shed); also in timeouts
    oom_costs: list[float] = field(
        default_factory=list
    )  # cost of each batch too big for memory (gpubroker.deployments.replica.oom)

    def add_latency(self, ms: float) -> None:
        self.latency_seen += 1
        if len(self.latency_ms) < MAX_LATENCY_SAMPLES:
            self.latency_ms.append(ms)
        else:  # reservoir sample: every completion equally likely to be kept
            j = random.randrange(self.latency_seen)
            if j < MAX_LATENCY_SAMPLES:
                self.latency_ms[j] = ms

    def merge(self, older: StatsDelta) -> None:
        """Fold an unsent older delta into this one (the broker was unreachable)."""
        self.started_s = min(self.started_s, older.started_s)
        for name in (
            "arrivals",
            "completions",
            "rejections",
            "timeouts",
            "errors",
            "oom_splits",
            "emergency_shrinks",
            "held_refusals",
            "shed",
        ):
            setattr(self, name, getattr(self, name) + getattr(older, name))
        for ms in older.latency_ms:
            self.add_latency(ms)
        self.batches = (older.batches + self.batches)[-MERGED_BATCHES_KEPT:]
        self.batch_requests = (older.batch_requests + self.batch_requests)[-MERGED_BATCHES_KEPT:]
        self.busy_s += older.busy_s
        self.mem_peak_bytes = max(self.mem_peak_bytes, older.mem_peak_bytes)
        self.oom_costs = older.oom_costs + self.oom_costs


@dataclass(frozen=True)
class ReplicaGauges:
    """What the replica reads at report time (not deltas)."""

    queue_depth: int
    mem_used_bytes: int
    device_free_frac: float | None
    sm_util_frac: float | None
    settings_version: int


class BrokerLink:
    """Register once, then one report per interval; settings come back in each reply."""

    def __init__(
        self,
        model: str,
        replica_id: str,
        get_handle: Callable[[], Any],
        *,
        rpc_timeout_s: float,
        clock: Callable[[], float] = time.time,
        card_id: str = "",
    ) -> None:
        self.model = model
        self.card_id = card_id  # the card this replica was placed on ("" in a one-card fleet)
        self.replica_id = replica_id
        self._get_handle = get_handle  # the actor's handle (or a stand-in with its `.remote` calls)
        self._broker: BrokerClient | None = None
        self.rpc_timeout_s = rpc_timeout_s
        self.clock = clock
        self.delta = StatsDelta(clock())
        self.seq = 0
        self.registered = False
        self.failures = 0
        self.last_ok_s: float | None = None

    def _broker_or_lookup(self) -> BrokerClient:
        if self._broker is None:
            self._broker = BrokerClient(self._get_handle(), self.rpc_timeout_s)
        return self._broker

    def _ok(self) -> None:
        self.last_ok_s = self.clock()
        self.failures = 0

    def _failed(self, exc: BaseException, what: str, version: int) -> None:
        self.failures += 1
        self._broker = None  # look the actor up again next time (it may have been re-created)
        if self.failures in (1, 10) or self.failures % 100 == 0:
            logger.warning(
                "gpubroker replica %s: broker %s failed (%d in a row, %r); serving on settings v%d",
                self.model,
                what,
                self.failures,
                exc,
                version,
            )

    async def register(self, calibration: Calibration, version: int) -> ModelSettings | None:
        """The broker's settings for this model, or None (serve on what we have, retry later)."""
        try:
            reply = await self._broker_or_lookup().register(self.model, self.replica_id, calibration, self.card_id)
        except Exception as exc:  # noqa: BLE001 - serve on config settings, retry from the report loop
            self._failed(exc, "register", version)
            return None
        self.registered = True
        self._ok()
        return reply

    def report_of(
        self, delta: StatsDelta, now_s: float, g: ReplicaGauges, engine: EngineReport | None = None
    ) -> StatsReport:
        """This replica's report of ``delta`` and the gauges read now, numbered ``self.seq``."""
        return StatsReport(
            model=self.model,
            replica_id=self.replica_id,
            seq=self.seq,
            now_s=now_s,
            interval_s=max(1e-3, now_s - delta.started_s),
            arrivals=delta.arrivals,
            completions=delta.completions,
            rejections=delta.rejections,
            timeouts=delta.timeouts,
            errors=delta.errors,
            latency_ms=tuple(round(x, 3) for x in delta.latency_ms),
            batches=tuple(delta.batches),
            batch_requests=tuple(delta.batch_requests),
            busy_s=delta.busy_s,
            queue_depth=g.queue_depth,
            mem_used_bytes=g.mem_used_bytes,
            mem_peak_bytes=max(delta.mem_peak_bytes, g.mem_used_bytes),
            device_free_frac=g.device_free_frac,
            sm_util_frac=g.sm_util_frac,
            oom_splits=delta.oom_splits,
            emergency_shrinks=delta.emergency_shrinks,
            held_refusals=delta.held_refusals,
            shed=delta.shed,
            settings_version=g.settings_version,
            oom_costs=tuple(delta.oom_costs),
            engine=engine,
            card_id=self.card_id,
        )

    async def report(self, gauges: ReplicaGauges, engine: EngineReport | None = None) -> ModelSettings | None:
        """Send the delta since the last report (``engine``: an LLM engine's report); the settings reply, or None."""
        now = self.clock()
        delta, self.delta = self.delta, StatsDelta(now)
        report = self.report_of(delta, now, gauges, engine)
        try:
            broker = self._broker_or_lookup()
        except Exception as exc:  # noqa: BLE001 - no broker: keep the counts for the next try
            self.delta.merge(delta)
            self._failed(exc, "lookup", gauges.settings_version)
            return None
        self.seq += 1
        try:
            reply = await broker.report(report)
        except TimeoutError as exc:
            # The call may still land (the actor retries tasks across restarts): do not resend.
            self._failed(exc, "report (timeout)", gauges.settings_version)
            return None
        except Exception as exc:  # noqa: BLE001 - actor gone: keep the counts for the next try
            self.delta.merge(delta)
            self._failed(exc, "report", gauges.settings_version)
            if "unknown model" in str(exc):
                self.registered = False
            return None
        self._ok()
        return reply
