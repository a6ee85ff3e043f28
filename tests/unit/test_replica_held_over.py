"""A replica that holds more than its grant runs no batch (and restarts itself when that lasts),
and a grant lowered while a batch runs is set when the batch ends (deployments/replica/deployment.py).

In-process (no Ray cluster): Serve's own ``@serve.batch`` batcher, a real ``BrokerCore`` behind a
``CoreLink``. The limiter is a FAKE (a replica built outside Serve sets no OS limit: it would
outlive the test in pytest's process) that records ``set_grant`` and says what it holds over the
grant; the real limit's floor is tested in tests/unit/test_enforce.py, the live reclaim in
tests/integration/test_reclaim_live.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from gpubroker.broker.core import BrokerCore
from gpubroker.deployments.replica.deployment import HELD_RESTART_T, ModelReplica
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink

MIB = 1024**2

CONFIG = """
broker: {name: held, namespace: held, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.01}
models:
  held:
    model: tests.unit.test_replica_held_over:GateModel
    quota: {min: 16MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 4, initial: 4}
    wait: {min_ms: 0, max_ms: 10, initial_ms: 0}
    slo_p95_ms: 5000
"""


class GateModel:
    """Counts its batches; a batch waits for ``release`` when ``block`` is set."""

    calls = 0
    block = False
    started = threading.Event()
    release = threading.Event()

    def validate(self, item):
        return {"x": int(item["x"])}

    def predict(self, items):
        type(self).calls += 1
        if type(self).block:
            type(self).started.set()
            assert type(self).release.wait(30)
        return [{"x": item["x"]} for item in items]

    def example_input(self, cost=None):
        return {"x": 1}


class FakeLimiter:
    """A FAKE limiter: records the grants set, holds ``held_over`` as the test says."""

    kind = "fake"

    def __init__(self):
        self.grant_bytes = None
        self.held_over = None
        self.grants: list[int] = []

    def set_grant(self, grant_bytes):
        self.grant_bytes = grant_bytes
        self.grants.append(grant_bytes)
        return None

    def refresh(self, after_oom=False):
        return None

    def release_caches(self):
        return None

    def read(self):
        return None


async def _replica(monkeypatch, tmp_path, used_bytes: list[int]) -> tuple[BrokerCore, ModelReplica, FakeLimiter]:
    core = BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=tmp_path / "ckpt.json")
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    GateModel.calls, GateModel.block = 0, False
    GateModel.started.clear()
    GateModel.release.clear()
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__("held", parse_config_text(CONFIG))
    r._report_task.cancel()
    limiter = FakeLimiter()
    r.limiter = limiter
    GateModel.calls = 0  # calibration ran the model at load

    def read_memory():  # the resident reading the broker sees, as the test sets it
        r.mem_used_bytes = used_bytes[0]
        return 0.5

    r._read_memory = read_memory
    return core, r, limiter


def test_a_replica_holding_over_its_lowered_grant_refuses_batches_before_the_model(monkeypatch, tmp_path):
    async def main():
        used = [300 * MIB]
        _, r, limiter = await _replica(monkeypatch, tmp_path, used)
        grant = r._grant_per_replica(r.settings)
        assert grant == 256 * MIB
        limiter.held_over = 60 * MIB  # the limiter's count: over the grant
        batches0 = len(r.delta.batches)
        out = await asyncio.gather(*[r.infer([{"x": i}]) for i in range(3)])
        assert [o["status"] for o in out] == [503] * 3, out
        assert "over its grant of 256.0 MiB" in out[0]["detail"] and out[0]["retry_after_s"] >= 1
        assert GateModel.calls == 0  # never reached the model
        assert r.delta.rejections == 3 and len(r.delta.batches) == batches0  # no latency sample
        await r.check_health()  # held, not yet for long
        r.held_since -= HELD_RESTART_T * r.cfg.broker.transfer_timeout_s  # held for the bound
        assert (await r.infer([{"x": 9}]))["status"] == 503
        with pytest.raises(RuntimeError, match="over its grant of 256.0 MiB, for .*Serve restarts"):
            await r.check_health()
        r.held_restart = ""  # (the restart's own test ends here; the rest is the same replica)
        used[0] = 200 * MIB  # resident memory under the grant (what the broker confirms on): it runs
        ok = await r.infer([{"x": 7}])
        assert ok["status"] == 200 and ok["outputs"] == [{"x": 7}] and GateModel.calls == 1
        used[0] = 300 * MIB
        limiter.held_over = None  # the limiter measures it under: it runs too
        assert (await r.infer([{"x": 8}]))["status"] == 200 and GateModel.calls == 2

    asyncio.run(main())


def test_a_grant_lowered_while_a_batch_runs_is_set_when_it_ends(monkeypatch, tmp_path):
    async def main():
        _, r, limiter = await _replica(monkeypatch, tmp_path, [0])
        GateModel.block = True
        running = asyncio.ensure_future(r.infer([{"x": 1}]))
        assert await asyncio.to_thread(GateModel.started.wait, 30)
        lower = dataclasses.replace(r.settings, version=r.settings.version + 1, grant_bytes=128 * MIB)
        r._apply(lower)
        assert limiter.grants == [] and r.enforce_pending  # not under the running batch
        lower2 = dataclasses.replace(r.settings, version=r.settings.version + 1, grant_bytes=64 * MIB)
        r._apply(lower2)
        assert limiter.grants == [] and r.enforce_pending
        lower = dataclasses.replace(r.settings, version=r.settings.version + 1, grant_bytes=128 * MIB)
        r._apply(lower)  # a raise under a running batch is set at once (it cuts nothing)
        assert limiter.grants == [128 * MIB] and not r.enforce_pending
        lower = dataclasses.replace(r.settings, version=r.settings.version + 1, grant_bytes=96 * MIB)
        r._apply(lower)
        assert limiter.grants == [128 * MIB] and r.enforce_pending
        GateModel.release.set()
        assert (await running)["status"] == 200
        assert limiter.grants == [128 * MIB, 96 * MIB] and not r.enforce_pending  # set as it ended
        higher = dataclasses.replace(r.settings, version=r.settings.version + 1, grant_bytes=256 * MIB)
        GateModel.block, GateModel.release = False, threading.Event()
        r._apply(higher)  # no batch running: set at once
        assert limiter.grants == [128 * MIB, 96 * MIB, 256 * MIB]

    asyncio.run(main())
