"""Status says why a cap is low: ``memory_ceiling`` and ``fixed_bytes`` (gpubroker.broker.control.policy.memory_view).

A replica whose runtime turns out heavier than its calibration (the demo's ``prof`` on a CPU
machine: about 40 MiB fixed against 32 calibrated) gets a batch ceiling below what the config's
figures promise. Status shows the ceiling the guard used and the fixed part it was measured
from, and the status table marks a cap that sits on it. Pure: a BrokerCore on a fake clock.
"""

from __future__ import annotations

from rich.console import Console

from gpubroker.broker.core import BrokerCore
from gpubroker.broker.fleet_core import FleetBroker
from gpubroker.cli.views import status_table
from tests.unit.test_oom import CONFIG, Clock, _report

MiB = 1024**2


def _run(core, clock: Clock, fixed_mib: float, ticks: int = 4) -> None:  # noqa: ANN001
    for seq in range(ticks):
        clock.t += 1
        cap = core.settings("m").max_batch_size
        _report(core, clock, seq, cap, mem_bytes=int((fixed_mib + cap) * MiB))  # 1 MiB an item over the fixed part
        core.tick()


def _render(st: dict) -> str:
    console = Console(width=220, record=True)
    console.print(status_table(st))
    return console.export_text()


def test_status_shows_the_ceiling_the_measured_fixed_part_leaves_and_the_table_marks_the_cap():
    clock = Clock()
    core = BrokerCore(CONFIG, clock=clock)
    core.register("m", "m-r0", {"weights_bytes": 10 * MiB, "bytes_per_unit": 1 * MiB, "cost_unit": "requests"})
    before = core.status()["models"]["m"]
    assert before["memory_ceiling"] is None and before["fixed_bytes"] is None  # no report yet
    _run(core, clock, fixed_mib=20.0)  # as calibrated, near enough: 1 GiB holds far more than the ceiling 64
    light = core.status()["models"]["m"]
    assert light["memory_ceiling"] > 64 and light["fixed_bytes"] == 20 * MiB
    assert " mem" not in _render(core.status())

    clock2 = Clock()
    heavy_core = BrokerCore(CONFIG, clock=clock2)
    heavy_core.register("m", "m-r0", {"weights_bytes": 10 * MiB, "bytes_per_unit": 1 * MiB, "cost_unit": "requests"})
    _run(heavy_core, clock2, fixed_mib=900.0)  # the runtime holds 900 MiB: 1 GiB x 0.9 headroom leaves 21 items
    heavy = heavy_core.status()["models"]["m"]
    assert heavy["fixed_bytes"] == 900 * MiB
    assert heavy["memory_ceiling"] == int((1024 * 0.9 - 900) // 1)  # 21, where the config's 10 MiB gives 911
    assert heavy["max_batch_size"] == heavy["memory_ceiling"]  # the guard held the busy model's cap there
    row = next(line for line in _render(heavy_core.status()).splitlines() if line.lstrip("│┃ ").startswith("m "))
    assert f"{heavy['max_batch_size']} mem" in row


def test_a_static_strategy_has_no_memory_ceiling_and_a_card_entry_carries_it():
    static = CONFIG.replace("control: {window_s: 30, min_samples: 5}", "control: {window_s: 30, strategy: static}")
    clock = Clock()
    core = BrokerCore(static, clock=clock)
    core.register("m", "m-r0", {"weights_bytes": 10 * MiB, "bytes_per_unit": 1 * MiB, "cost_unit": "requests"})
    _run(core, clock, fixed_mib=900.0)
    assert core.status()["models"]["m"]["memory_ceiling"] is None  # a static cap is the user's, memory aside

    clock2 = Clock()
    fleet = FleetBroker(CONFIG, clock=clock2)
    fleet.register("m", "m-r0", {"weights_bytes": 10 * MiB, "bytes_per_unit": 1 * MiB, "cost_unit": "requests"})
    _run(fleet, clock2, fixed_mib=900.0)
    st = fleet.status()
    assert st["cards"][0]["models"]["m"]["memory_ceiling"] == st["models"]["m"]["memory_ceiling"] == 21
