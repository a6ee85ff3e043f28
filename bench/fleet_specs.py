"""The fleet entries and config documents the live benchmarks deploy: a ``profiled`` or MiniLM
model spec, the same pinned static, and the fleet YAML around them (``bench.scenarios``
re-exports them)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from bench.tagged import TAGGED

MiB = 1024**2


def profiled_spec(
    a_ms: float,
    c_ms: float,
    cap_ms: float,
    *,
    ceiling: int = 128,
    floor: int = 2,
    weights_bytes: int = 16 * MiB,
    bytes_per_item: int = 256 * 1024,
    quota: Mapping[str, str] | None = None,
    window_s: float = 10.0,
) -> dict[str, Any]:
    """A fleet-config model entry for the tagged ``profiled`` emulation L(b) = a + c·b."""
    return {
        "model": TAGGED["profiled"],
        "options": {
            "a_ms": a_ms,
            "c_ms": c_ms,
            "weights_bytes": int(weights_bytes),
            "bytes_per_item": int(bytes_per_item),
            "unit": "requests",
        },
        "quota": dict(quota or {"min": "256MiB", "base": "1GiB", "max": "2GiB"}),
        "batch": {"floor": floor, "ceiling": ceiling},
        "wait": {"min_ms": 0, "max_ms": 50},
        "slo_p95_ms": round(float(cap_ms), 3),
        "max_queued": 2048,
        "request_timeout_s": 20,
        "control": {"window_s": window_s},
    }


def minilm_spec(
    cap_ms: float,
    *,
    ceiling: int = 2048,
    floor: int = 32,
    threads: int = 1,
    quota: Mapping[str, str] | None = None,
    window_s: float = 10.0,
) -> dict[str, Any]:
    """A fleet-config model entry for the tagged MiniLM (token-priced)."""
    return {
        "model": TAGGED["minilm"],
        "options": {"threads": threads, "max_tokens": 256},
        "quota": dict(quota or {"min": "768MiB", "base": "1536MiB", "max": "2GiB"}),
        "batch": {"unit": "tokens", "floor": floor, "ceiling": ceiling},
        "wait": {"min_ms": 0, "max_ms": 50},
        "slo_p95_ms": round(float(cap_ms), 3),
        "max_queued": 2048,
        "request_timeout_s": 20,
        "max_body_bytes": "64KiB",
        "control": {"window_s": window_s},
    }


def pin_static(spec: Mapping[str, Any], batch: int, wait_ms: float) -> dict[str, Any]:
    """The same model entry pinned to a static batch cap and wait (``control.strategy: static``)."""
    s = copy.deepcopy(dict(spec))
    b = s.setdefault("batch", {})
    b["initial"] = int(batch)
    b["floor"] = min(int(b.get("floor", 2)), int(batch))
    b["ceiling"] = max(int(b.get("ceiling", 64)), int(batch))
    w = s.setdefault("wait", {})
    w["initial_ms"] = float(wait_ms)
    w["min_ms"] = min(float(w.get("min_ms", 0)), float(wait_ms))
    w["max_ms"] = max(float(w.get("max_ms", 50)), float(wait_ms))
    s.setdefault("control", {})["strategy"] = "static"
    return s


def fleet_yaml(
    models: Mapping[str, Mapping[str, Any]],
    *,
    broker_name: str,
    capacity: str = "8GiB",
    control_interval_s: float = 0.5,
    report_interval_s: float = 0.25,
    http_port: int = 8000,
    direct_ingress: bool = False,
) -> str:
    doc: dict[str, Any] = {
        "broker": {
            "name": broker_name,
            "namespace": "gpubroker-bench",
            "control_interval_s": control_interval_s,
            "report_interval_s": report_interval_s,
            "metrics_port": 0,
            "http_host": "127.0.0.1",
            "http_port": http_port,
        },
        "gpu": {"device": "cpu", "capacity": capacity, "reserve_frac": 0.0, "emergency_free_frac": 0.05},
        "models": {k: dict(v) for k, v in models.items()},
    }
    if direct_ingress:
        doc["broker"]["direct_ingress"] = True
    return yaml.safe_dump(doc, sort_keys=False)
