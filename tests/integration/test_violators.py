"""Models that go around their in-process limit, held by the measurement layer alone (issue 37).

Real Ray Serve on CPU, the cgroup turned off (``GPUBROKER_CGROUP=off``), so what ends a violator
is the watcher (``gpubroker.deployments.enforce.watch``): over grant + slack past the grace, refuse, drain, end.
Each violator keeps 48 MiB a request, 2 a second for 20 s, on a 256 MiB grant, beside ``mlp``:

- ``sneaky``: lifts its soft RLIMIT_DATA, allocates, and puts the limit back: the measurement
  catches it, or the re-assert at a report that falls inside the lift;
- ``shared``: numpy over an anonymous shared mapping (outside torch, outside RLIMIT_DATA's count);
- ``heap``: bytearray (outside torch, inside RLIMIT_DATA's count): the in-process limit refuses
  it first and the process never goes over grant + slack; held over its grant it restarts itself.

For each: the time over grant + slack until the process ended is within ``END_BOUND_S``, the
neighbour answers every request with 200, the violator serves again once its load stops. Each
writes a chaos row (violations injected, and stopped within the bound, as measured) counting every
request sent: the violator's own (200, 503 refused while it drains, 507 over its grant), its
neighbour's and the ones that found it serving again.
"""

from __future__ import annotations

import os

import pytest

from gpubroker.deployments.cluster.fleet import APP_NAME
from gpubroker.deployments.enforce.watch import CGROUP_ENV, END_BOUND_S
from tests.chaos.harness import FaultKind, Faults
from tests.integration._fleet import local_fleet, replica_status
from tests.integration._violation import drive_violator, serves_again

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MiB = 1024**2

CONFIG = """
broker: {name: gpubroker-violators, namespace: gpubroker-violators, control_interval_s: 0.5,
         report_interval_s: 0.25, transfer_timeout_s: 2, metrics_port: 0, http_host: 127.0.0.1,
         http_port: 8000}
gpu: {device: cpu, capacity: 2GiB, reserve_frac: 0.0, emergency_free_frac: 0.05}
models:
  sneaky:
    model: tests.integration.violator_models:SneakyLifterModel
    quota: {min: 128MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 4, initial: 1}
    slo_p95_ms: 5000
  shared:
    model: tests.integration.violator_models:OutsideModel
    options: {how: numpy}
    quota: {min: 128MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 4, initial: 1}
    slo_p95_ms: 5000
  heap:
    model: tests.integration.violator_models:OutsideModel
    options: {how: bytearray}
    quota: {min: 128MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 4, initial: 1}
    slo_p95_ms: 5000
  mlp:
    model: mlp
    quota: {min: 512MiB, base: 512MiB, max: 512MiB}
    batch: {floor: 2, ceiling: 32}
    slo_p95_ms: 2000
    control: {window_s: 20, min_samples: 5}
"""


@pytest.fixture(scope="module")
def fleet():
    old = os.environ.get(CGROUP_ENV)
    os.environ[CGROUP_ENV] = "off"  # the Ray workers (and their watchdogs) inherit it
    try:
        with local_fleet(CONFIG) as (url, broker, cfg):
            yield url, broker, APP_NAME
    finally:
        if old is None:
            os.environ.pop(CGROUP_ENV, None)
        else:
            os.environ[CGROUP_ENV] = old


@pytest.mark.chaos
@pytest.mark.parametrize("model", ["sneaky", "shared", "heap"])
def test_a_violator_is_ended_by_the_watcher_within_the_bound_and_its_neighbour_keeps_serving(fleet, model):
    import ray

    url, broker, app = fleet
    st = replica_status(app, model)
    assert st["enforcement"] == "rlimit+watch" and st["cgroup"] == "", (st["enforcement"], st["cgroup"])
    v = drive_violator(
        url,
        app,
        model,
        48,
        2.0,
        20.0,
        "mlp",
        {"input": {"x": [0.1] * 64}},
        during=lambda: ray.get(broker.status.remote(), timeout=30)["models"]["mlp"],  # while its window holds the run
    )
    mlp = v.during
    new_pid, status = serves_again(url, app, model, v.pid, tally=v.own, new_process=model != "heap")
    went_over = v.peak_over_bytes > v.bound_bytes
    figure = (
        f"{model}: peak {v.peak_over_bytes / MiB:.0f} MiB over baseline on a {v.grant_bytes / MiB:.0f} MiB grant, "
        f"over grant+slack {v.over_s:.2f}s (bound {END_BOUND_S:g}s), ended {v.ended}; {model} {dict(v.codes)}; "
        f"mlp {dict(v.neighbour)}, attainment {mlp['attainment']}; first 503: {(v.details or [''])[0][:200]}"
    )
    print(figure)
    faults = Faults(f"violator-{model}", f"{model} keeps 48 MiB a request past its grant", FaultKind.MEMORY)
    faults.check("stopped within the bound", v.over_s <= END_BOUND_S and (v.ended or not went_over))
    faults.record(v.requests, ok=set(v.neighbour) == {200}, figure=figure)
    assert v.over_s <= END_BOUND_S, figure
    if model == "heap":  # held by the in-process limit: never over grant + slack, so never a violation
        assert not went_over, figure
    else:  # shared: only the measurement sees it; sneaky: the measurement, or a report inside its lift
        assert v.ended and (went_over or model == "sneaky"), figure
        assert any(f"model '{model}'" in d and "grant" in d and "MiB" in d for d in v.details), v.details[:3]
    assert set(v.neighbour) == {200}, figure
    assert mlp["attainment"] is not None and mlp["attainment"] >= 0.95, mlp
    assert status == 200 and (new_pid != v.pid or model == "heap"), (new_pid, status)  # heap: held at its grant, alive
