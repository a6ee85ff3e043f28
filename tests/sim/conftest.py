"""Shared helpers for the simulator tests: small configs built in code."""

from __future__ import annotations

from typing import Any

import pytest

from gpubroker.quotas.config import FleetConfig, parse_config

GiB = 1024**3
MiB = 1024**2


def profiled(
    a_ms: float,
    c_ms: float,
    *,
    weights: int = 1 * GiB,
    per_item: int = 16 * MiB,
    base: str = "8GiB",
    mx: str = "16GiB",
    mn: str = "2GiB",
    ceiling: int = 128,
    slo_ms: float = 100.0,
    unit: str = "requests",
    **extra: Any,
) -> dict[str, Any]:
    spec = {
        "model": "profiled",
        "options": {"a_ms": a_ms, "c_ms": c_ms, "weights_bytes": weights, "bytes_per_item": per_item, "unit": unit},
        "quota": {"min": mn, "base": base, "max": mx},
        "batch": {"floor": 2, "ceiling": ceiling, "unit": unit},
        "wait": {"min_ms": 0, "max_ms": 50},
        "slo_p95_ms": slo_ms,
        "max_queued": 100_000,
    }
    spec.update(extra)
    return spec


def fleet(models: dict[str, dict[str, Any]], capacity: str = "80GiB", **broker: Any) -> FleetConfig:
    return parse_config(
        {
            "broker": {"control_interval_s": 1.0, "report_interval_s": 0.5, **broker},
            "gpu": {"device": "cpu", "capacity": capacity, "reserve_frac": 0.12},
            "models": models,
        }
    )


@pytest.fixture
def a20() -> FleetConfig:
    return fleet({"prof": profiled(20, 0.5, slo_ms=52)})


def have_policy() -> bool:
    try:
        import gpubroker.broker.control.policy  # noqa: F401
        import gpubroker.broker.control.window  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True
