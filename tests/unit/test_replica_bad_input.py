"""The replica's batch path when ``predict`` raises, in-process (no Ray cluster): Serve's own
``@serve.batch`` batcher, a real ``BrokerCore`` behind a ``CoreLink``.

Eleven requests of twelve inputs form one batch (initial cap 12, a 200 ms wait); two of them carry inputs the model
refuses inside ``predict`` (``InputError``: 422) or cannot read (``ValueError``: 500), and the
model's error quotes every input of the batch. Each bad request gets its own error, naming its
item; every good one its own output; no answer holds another request's text.
"""

from __future__ import annotations

import asyncio
import json

from gpubroker.broker.core import BrokerCore
from gpubroker.deployments.models import InputError, OutputCountError
from gpubroker.deployments.replica.deployment import ModelReplica, batch_failure_detail
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink

MIB = 1024**2

CONFIG = """
broker: {name: picky, namespace: picky, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.01}
models:
  picky:
    model: tests.unit.test_replica_bad_input:PickyModel
    quota: {min: 16MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 16, initial: 12}
    wait: {min_ms: 0, max_ms: 200, initial_ms: 200}
    slo_p95_ms: 5000
"""


class PickyModel:
    """Input {"text": str}: "refuse..." is refused in predict (InputError), "crash..." raises."""

    batches: list[int] = []

    def validate(self, item):
        return {"text": str(item["text"])}

    def predict(self, items):
        type(self).batches.append(len(items))
        everyone = ", ".join(item["text"] for item in items)
        if any(item["text"].startswith("refuse") for item in items):
            raise InputError("text", f"refused: {everyone}")
        if any(item["text"].startswith("crash") for item in items):
            raise ValueError(f"cannot read {everyone}")
        return [{"echo": item["text"]} for item in items]

    def example_input(self, cost=None):
        return {"text": "example"}


async def _replica(monkeypatch, tmp_path) -> ModelReplica:
    core = BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=tmp_path / "ckpt.json")
    link = CoreLink(core)
    monkeypatch.setattr(ModelReplica, "_broker_handle", lambda self: link)
    from ray.serve import batching

    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
    r = ModelReplica.__new__(ModelReplica)
    await r.__init__("picky", parse_config_text(CONFIG))
    r._report_task.cancel()
    return r


def test_bad_inputs_in_a_shared_batch_fail_alone_with_their_own_errors(monkeypatch, tmp_path):
    async def main():
        r = await _replica(monkeypatch, tmp_path)
        PickyModel.batches.clear()
        texts = [f"good{i:02d}" for i in range(11)]
        texts[3], texts[8] = "refuse03", "crash08"
        bodies = [[{"text": t}] for t in texts]
        bodies[10] = [{"text": "good10"}, {"text": "crash10b"}]  # a request with a bad second input: 12 items
        out = await asyncio.gather(*(r.infer(b) for b in bodies))
        assert PickyModel.batches[0] == 12, PickyModel.batches  # they did share one batch
        assert out[3] == {"status": 422, "detail": "inputs[0].text: refused: refuse03", "field": "inputs[0].text"}
        assert out[8]["status"] == 500 and out[8]["field"] == "inputs[0]"
        assert out[8]["detail"] == "model 'picky' failed on inputs[0]: ValueError: cannot read crash08"
        assert out[10]["status"] == 500 and out[10]["detail"].endswith("inputs[1]: ValueError: cannot read crash10b")
        for i, answer in enumerate(out):
            if i not in (3, 8, 10):
                assert answer["status"] == 200 and answer["outputs"] == [{"echo": texts[i]}], answer
            others = [t for j, t in enumerate(texts) if j != i] + (["crash10b"] if i != 10 else [])
            assert not any(t in json.dumps(answer) for t in others), (i, answer)
        assert r.delta.errors == 4 and r.delta.oom_splits == 0  # counted by input: 3 requests, 4 inputs
        assert (await r.infer([{"text": "good"}]))["status"] == 200  # still serving

    asyncio.run(main())


def test_a_failure_no_input_explains_names_the_type_not_the_text():
    secret = ValueError("cannot read someone-elses-input")
    assert batch_failure_detail("picky", secret) == (
        "model 'picky' failed running this request: ValueError (the replica's log has the error)"
    )
    count = OutputCountError("model returned 2 outputs for a batch of 3 inputs")
    assert "2 outputs for a batch of 3" in batch_failure_detail("picky", count)
