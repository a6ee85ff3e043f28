"""An LLM replica's side of the broker's report/reply path: one report per interval, bounds in the reply.

Like a batch replica (``gpubroker.deployments.replica.broker_link``), the server sends one ``StatsReport`` delta per
``report_interval_s`` with its engine's report in ``engine``, and ``apply`` sets the bounds from
``ModelSettings.engine`` (bounds at once, the KV cache at the next drain); the broker never calls
the server. Memory is the engine's own account (weights + KV cache), what the grant governs. A lost
report leaves the last bounds in force. The clock and the broker handle are injected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from gpubroker.broker.wire import EngineReport, ModelSettings
from gpubroker.deployments.llm.vllm_engine import VllmEngine
from gpubroker.deployments.replica.broker_link import BrokerLink, ReplicaGauges

logger = logging.getLogger("ray.serve")


def weights_bytes(engine: VllmEngine) -> int:
    return engine.weights_bytes()


def engine_link(
    model: str, replica_id: str, get_handle: Callable[[], Any], report_interval_s: float, card_id: str = ""
) -> BrokerLink:
    """The broker link an engine reports over: an RPC may take up to four report intervals (2 s at least)."""
    return BrokerLink(model, replica_id, get_handle, rpc_timeout_s=max(2.0, 4.0 * report_interval_s), card_id=card_id)


class EngineReporter:
    """Counts one engine's requests into a ``BrokerLink`` delta; ``report_once`` sends it and applies the reply."""

    def __init__(
        self,
        engine: VllmEngine,
        link: BrokerLink,
        *,
        report_interval_s: float,
        engine_report: Callable[[], EngineReport],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.report_interval_s = float(report_interval_s)
        self.link = link  # engine_link(...): the model, replica and card it reports as
        self._engine_report = engine_report
        self._clock = clock
        self.settings: ModelSettings | None = None  # the broker's last reply
        self.applied: dict[str, Any] | None = None  # engine bounds applied from it
        self._last_tokens_out = 0
        self._last_report_s = clock()

    # ------------------------------------------------------------ counting (the server calls these)
    def arrived(self) -> None:
        self.link.delta.arrivals += 1

    def refused(self) -> None:
        self.link.delta.rejections += 1

    def finished(self, latency_ms: float, ok: bool) -> None:
        if ok:
            self.link.delta.completions += 1
            self.link.delta.add_latency(latency_ms)
        else:
            self.link.delta.errors += 1

    # ------------------------------------------------------------ one round trip
    def mem_used_bytes(self) -> int:
        return weights_bytes(self.engine) + self.engine.kv_cache_bytes()

    async def report_once(self) -> bool:
        """Send the delta and the engine report; apply the engine bounds in the reply. False: no reply."""
        report = replace(self._engine_report(), weights_bytes=weights_bytes(self.engine))
        now = self._clock()
        # busy: generating now, or tokens came out since the last report (a short burst between reports)
        if report.running or report.tokens_out > self._last_tokens_out:
            self.link.delta.busy_s += max(0.0, now - self._last_report_s)
        self._last_tokens_out, self._last_report_s = report.tokens_out, now
        used = self.mem_used_bytes()
        self.link.delta.mem_peak_bytes = max(self.link.delta.mem_peak_bytes, used)
        version = self.settings.version if self.settings is not None else 0
        gauges = ReplicaGauges(
            queue_depth=report.running + report.waiting,
            mem_used_bytes=used,
            device_free_frac=None,
            sm_util_frac=None,
            settings_version=version,
        )
        reply = await self.link.report(gauges, engine=report)
        if reply is None:
            return False
        self.apply(reply)
        return True

    def apply(self, settings: ModelSettings) -> dict[str, Any] | None:
        """Apply a settings reply's engine bounds (unchanged bounds are not set again); what was applied."""
        self.settings = settings
        bounds = settings.engine
        if bounds is None or asdict(bounds) == self.applied:
            return None
        applied = self.engine.set_bounds(bounds.max_num_seqs, bounds.max_batched_tokens, bounds.prefill_paused)
        target = self.engine.set_kv_cache_blocks(bounds.kv_blocks)
        self.applied = asdict(bounds)
        return {
            "max_num_seqs": applied.max_num_seqs,
            "max_batched_tokens": applied.max_batched_tokens,
            "prefill_paused": applied.prefill_paused,
            "kv_blocks_target": target,
        }

    async def run(self) -> None:
        """Report every interval until cancelled; the loop survives anything else."""
        while True:
            await asyncio.sleep(self.report_interval_s)
            try:
                await self.report_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("gpubroker llm %s: report loop error", self.link.model)
