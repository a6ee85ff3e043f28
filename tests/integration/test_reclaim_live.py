"""A reclaim under a borrower that holds memory, on a real fleet (Ray Serve, CPU): the owner's base
comes back through the whole escalation (issue 11, deliverable 3).

``hog`` (``tests.integration.hold_model``) keeps every byte it allocates. Busy while ``owner``
idles, it borrows from ``owner`` and fills the loan; then ``owner``'s load returns and it
reclaims its base. ``hog`` holds on whatever its cap, caches or admission say, so the broker
goes through every step (each a decision-log move, ``transfer_timeout_s`` after the previous)
to the restart, its worker alive throughout (held over its lowered grant, it runs no batch): ``hog``'s replica fails its health check, Serve replaces it, the new process
holds nothing, the reclaim confirms and ``owner`` is back at its base. The test prints each
step's time after the reclaim began and the bound of ``gpubroker.broker.control.lending``.
"""

from __future__ import annotations

import pytest

from tests.integration._fleet import local_fleet
from tests.integration._load import open_loop_bg
from tests.integration.conftest import wait_for

# slow: a live escalation (cap, cache, drain, restart) whose timing depends on the machine; it failed
# in 2 of 4 full integration runs on a loaded 2-core machine and passed alone. On 2026-12-02 (AMD
# EPYC) it failed alone as well until that day's fix: the limit went under what HoldModel held, Ray's
# own next allocation failed and the worker exited, a restart outside the escalation. Now a replica
# held over its grant keeps the runtime's slack and runs no batch (docs/ENFORCEMENT.md, "Held over
# the grant"). The same bound is tested on a fake clock in tests/unit/test_two_phase.py.
# `make chaos` runs it.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1024**2
T_S = 3.0  # transfer_timeout_s
CONFIG = f"""
broker: {{name: gpubroker-reclaim, namespace: gpubroker-reclaim, control_interval_s: 0.5,
         report_interval_s: 0.25, transfer_timeout_s: {T_S}, metrics_port: 0, http_host: 127.0.0.1,
         http_port: 8000}}
gpu: {{device: cpu, capacity: 640MiB, reserve_frac: 0.0, emergency_free_frac: 0.01}}
models:
  hog:
    model: tests.integration.hold_model:HoldModel
    options: {{mb_per_item: 4, max_held_mb: 256, hold_ms: 20}}
    quota: {{min: 64MiB, base: 128MiB, max: 512MiB}}
    batch: {{floor: 1, ceiling: 64, initial: 8}}
    wait: {{min_ms: 0, max_ms: 20}}
    slo_p95_ms: 5000
    request_timeout_s: 60
    control: {{window_s: 6, idle_hold_s: 2, reclaim_hold_s: 1, min_samples: 5}}
  owner:
    model: tests.integration.hold_model:HoldModel
    options: {{mb_per_item: 1, max_held_mb: 4, hold_ms: 150}}
    quota: {{min: 64MiB, base: 512MiB, max: 512MiB}}
    batch: {{floor: 1, ceiling: 8, initial: 2}}
    wait: {{min_ms: 0, max_ms: 20}}
    slo_p95_ms: 5000
    request_timeout_s: 60
    control: {{window_s: 6, idle_hold_s: 2, reclaim_hold_s: 1, min_samples: 5}}
"""


@pytest.fixture(scope="module")
def fleet():
    with local_fleet(CONFIG) as (url, broker, cfg):
        yield url, broker


def test_reclaim_under_a_holding_borrower_returns_the_base(fleet):
    import ray

    url, broker = fleet

    def status() -> dict:
        return ray.get(broker.status.remote(), timeout=30)["models"]

    def moves() -> list[dict]:
        return [d for d in ray.get(broker.decisions.remote(), timeout=30) if d["kind"] == "move"]

    # hog busy, owner idle: hog borrows from owner and fills what it is granted
    open_loop_bg(url, "hog", 60.0, 50.0, {"input": {"x": 1}}, seed=1, timeout_s=60)

    def borrowed_and_full():
        hog = status()["hog"]
        return (hog["grant_bytes"] > 128 * MiB and hog["used_bytes"] > 160 * MiB) or (
            False,
            hog["grant_bytes"] // MiB,
            hog["used_bytes"] // MiB,
            hog["max_batch_size"],
            hog["queue_depth"],
        )

    wait_for(lambda: borrowed_and_full() is True, 45, what="hog borrowed from owner and holds more than its base")
    # owner's load returns (hog stays busy and keeps what it holds)
    open_loop_bg(url, "owner", 30.0, 40.0, {"input": {"x": 1}}, seed=2, timeout_s=60)
    wait_for(
        lambda: any(m["move"] == "reclaim" and m["donor"] == "hog" for m in moves()),
        30,
        what="owner reclaims its base from hog's loan",
    )
    wait_for(
        lambda: status()["owner"]["grant_bytes"] >= 512 * MiB,
        120,
        interval_s=0.5,
        what="owner back at its base after the escalation",
    )
    log = moves()
    begun = next(m["time_s"] for m in log if m["move"] == "reclaim" and m["donor"] == "hog")
    steps = [
        (m["move"], m["time_s"] - begun)
        for m in log
        if m["donor"] == "hog"
        and m["time_s"] >= begun
        and m["move"] in ("reclaim_cache", "reclaim_drain", "reclaim_restart", "confirm")
    ]
    shown = ", ".join(f"{kind} at {after_s:.1f} s" for kind, after_s in steps)
    print(
        f"reclaim from hog, after it began: {shown}; bound 3T + restart + stale_after_s + control_interval_s, T = {T_S:g} s"
    )
    kinds = [k for k, _ in steps]
    assert kinds[:3] == ["reclaim_cache", "reclaim_drain", "reclaim_restart"], steps
    assert "confirm" in kinds, steps
    for k, (_, after_s) in enumerate(steps[:3], start=1):  # step k once k x T has passed since the reclaim began
        assert after_s >= k * T_S, steps
    # the base came back through the restart: a new hog replica registered after it was asked for
    restart_s = begun + steps[2][1]
    entries = ray.get(broker.decisions.remote(), timeout=30)
    assert [d for d in entries if d["kind"] == "register" and d.get("model") == "hog" and d["time_s"] >= restart_s], (
        "no hog replica registered after the restart"
    )
    # and hog's first worker lived until then: held over its grant it ran no batch, so the runtime
    # kept its slack (before 2026-12-02 the worker exited at its limit and re-registered early)
    early = [
        d["time_s"] for d in entries if d["kind"] == "register" and d.get("model") == "hog" and d["time_s"] < restart_s
    ]
    assert len(early) == 1, f"hog registered {len(early)} times before the restart step"
