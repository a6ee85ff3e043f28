"""``gpubroker status`` names each model's memory layers (issue 37): what its replicas registered
(``cgroup``, ``rlimit+watch``, ``fraction+watch``, ``watch``), live replicas only, in both views."""

from __future__ import annotations

from rich.console import Console

from gpubroker.broker.core import BrokerCore
from gpubroker.cli import views

CONFIG = """
broker: {name: st, namespace: st, control_interval_s: 1.0, report_interval_s: 0.5, metrics_port: 0}
gpu: {device: cpu, capacity: 2GiB, reserve_frac: 0.0}
models:
  a: {model: mlp, quota: {min: 64MiB, base: 256MiB, max: 512MiB}}
  b: {model: mlp, quota: {min: 64MiB, base: 256MiB, max: 512MiB}}
"""


def render(table) -> str:
    console = Console(width=400, record=True)
    console.print(table)
    return console.export_text()


def test_status_shows_each_models_enforcement_from_its_live_replicas():
    now = [1000.0]
    core = BrokerCore(CONFIG, clock=lambda: now[0])
    core.register("a", "a-1", {"enforcement": "cgroup"})
    core.register("b", "b-1", {"enforcement": "rlimit+watch"})
    core.register("b", "b-2", {"enforcement": "cgroup"})
    st = core.status()
    assert st["models"]["a"]["enforcement"] == "cgroup"
    assert st["models"]["b"]["enforcement"] == "cgroup/rlimit+watch"
    now[0] += 60.0  # silent replicas no longer count
    core.register("b", "b-3", {"enforcement": "watch"})
    st = core.status()
    assert "enforcement" not in st["models"]["a"] and st["models"]["b"]["enforcement"] == "watch"
    assert "enforce" in render(views.status_table(st)) and " watch " in render(views.status_table(st))
