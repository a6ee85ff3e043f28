"""The broker's /metrics endpoint, and metrics that record nothing (the simulator's)."""

from __future__ import annotations

import logging
from typing import Any

from broker.wire import FleetDecision, StatsReport

logger = logging.getLogger("gpubroker.metrics")


class Exporter:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    def __init__(self, server: Any, thread: Any, host: str, port: int) -> None:
        self.server, self.thread, self.host, self.port = server, thread, host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_exporter(metrics: Any, host: str = "127.0.0.1", port: int = 9464) -> Exporter | None:
    """Serve ``metrics.registry`` (a ``broker.metrics.BrokerMetrics``) at ``http://host:port/metrics``; None when disabled (port 0) or not possible.

    A port already in use (another broker, or a second exporter in the same process) is logged
    as an error naming the port and the config field to change; the broker keeps running.
    """
    if not port:
        logger.info("metrics exporter disabled (broker.metrics_port is 0)")
        return None
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        logger.error(
            "metrics exporter could not bind %s:%d (%s); the broker runs without /metrics. "
            "Free the port or set broker.metrics_port to another port (0 disables the exporter).",
            host,
            port,
            exc.strerror or exc,
        )
        return None
    exporter = Exporter(server, thread, host, int(server.server_address[1]))
    logger.info("metrics exporter serving %s", exporter.url)
    return exporter


class NullMetrics:
    """Metrics that record nothing: for the simulator, whose thousands of virtual ticks a second
    need no Prometheus series (and no ``status()`` per tick to feed them)."""

    active = False

    def observe_report(self, report: StatsReport) -> None:
        pass

    def observe_rejections(self, model: str, count: int) -> None:
        pass

    def observe_tick(self, decision: FleetDecision, status: dict[str, Any], tick_s: float) -> None:
        pass

    def observe_reload(self, ok: bool, config_hash: str) -> None:
        pass

    def observe_checkpoint(self, write_s: float) -> None:
        pass
