"""The replica's batch path under out-of-memory errors, in-process (no Ray cluster): Serve's own
``@serve.batch`` batcher, the fast loop, a real ``BrokerCore`` behind a ``CoreLink``.

The model here runs out of memory itself (``BudgetModel``: a batch whose items ask for more than
4 units fails), so no OS limit is needed (a replica built outside Serve sets none): an oversize
input gets 507 naming its need and the grant while every other request of its batch gets 200;
the batch that was too big is reported in ``oom_costs``, caps the replica's own batch below it at
once, and the broker's next tick keeps the cap below it.
"""

from __future__ import annotations

import asyncio

from gpubroker.broker.core import BrokerCore
from gpubroker.deployments.models import EmulatedOOM
from gpubroker.deployments.replica.deployment import ModelReplica
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink

MIB = 1024**2
BUDGET_UNITS = 4

CONFIG = """
broker: {name: room, namespace: room, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.01}
models:
  budget:
    model: tests.unit.test_replica_oom:BudgetModel
    quota: {min: 16MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 16, initial: 12}
    wait: {min_ms: 0, max_ms: 200, initial_ms: 200}
    slo_p95_ms: 5000
"""


class BudgetModel:
    """Input {"n": int}; a batch asking for more than BUDGET_UNITS in all runs out of memory."""

    def validate(self, item):
        return {"n": int(item["n"])}

    def predict(self, items):
        need = sum(item["n"] for item in items)
        if need > BUDGET_UNITS:
            raise EmulatedOOM(f"batch needs {need} units > {BUDGET_UNITS}")
        return [{"n": item["n"]} for item in items]

    def example_input(self, cost=None):
        return {"n": 1}


async def _replica(monkeypatch, tmp_path) -> tuple[BrokerCore, ModelReplica]:
    core = BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=tmp_path / "ckpt.json")
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__("budget", parse_config_text(CONFIG))
    r._report_task.cancel()
    return core, r


def test_oversize_input_fails_alone_and_the_batch_too_big_lowers_the_cap(monkeypatch, tmp_path):
    async def main():
        core, r = await _replica(monkeypatch, tmp_path)
        assert r.limiter.kind == "unenforced"  # outside Serve: pytest's own process is not limited
        cap0 = r.cap
        assert cap0 == 12
        calls = [r.infer([{"n": 1}]) for _ in range(11)] + [r.infer([{"n": 9}])]  # one batch of 12
        out = await asyncio.gather(*calls)
        codes = [o["status"] for o in out]
        assert codes == [200] * 11 + [507], out
        oom = out[-1]
        assert oom["field"] == "inputs[0]" and "out of memory running this item alone" in oom["detail"]
        assert oom["grant_bytes"] == 256 * MIB and "grant of 256.0 MiB" in oom["detail"]
        assert [o["outputs"] for o in out[:11]] == [[{"n": 1}]] * 11
        costs = list(r.delta.oom_costs)
        assert (
            costs and min(costs) > BUDGET_UNITS
        )  # a batch of 6 ones ran out of memory (the halves holding 9 do not count)
        assert r.cap <= int(min(costs)) - 1 < cap0  # the local cap dropped at once
        assert r.delta.errors == 1 and r.delta.oom_splits >= 2
        assert await r.report_once()
        core.tick()
        assert core.settings("budget").max_batch_size <= int(min(costs)) - 1
        again = await r.infer([{"n": 1}, {"n": 1}])  # still serving
        assert again["status"] == 200

    asyncio.run(main())
