"""``gpubroker.managed`` without a Ray cluster: the decorator on a plain Serve class, its
``@serve.batch`` methods found and counted, the broker's settings applied to Ray's own batcher
(Serve's batcher runs in-process), and a report round trip with a real ``BrokerCore`` behind a
``CoreLink``."""

from __future__ import annotations

import asyncio

import pytest
from ray import serve

from gpubroker import managed
from gpubroker.broker.core import BrokerCore
from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.replica.broker_link import BrokerLink
from gpubroker.deployments.serve.managed import (
    STATE_ATTR,
    ManagedReplica,
    batch_methods,
    calibration_of,
    model_spec,
)
from gpubroker.quotas.config import parse_config_text
from tests.chaos.harness import CoreLink

MIB = 1024**2
CONFIG = """
broker: {name: m, namespace: m, control_interval_s: 0.5, report_interval_s: 0.25, metrics_port: 0}
gpu: {device: cpu, capacity: 1GiB, reserve_frac: 0.0}
models:
  scorer:
    model: tests.unit.test_managed:Scorer
    quota: {min: 64MiB, base: 256MiB, max: 512MiB}
    batch: {floor: 2, ceiling: 64, initial: 4}
    wait: {min_ms: 0, max_ms: 50, initial_ms: 5}
    profile: {a_ms: 5, c_ms: 1, weights_bytes: 32MiB, bytes_per_item: 8MiB}
    replicas: 2
  other:
    model: tests.unit.test_managed:Scorer
    quota: {min: 64MiB, base: 256MiB, max: 512MiB}
"""


class Scorer:
    """A plain Ray Serve class: a batch method, a streaming one, a plain one."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = factor
        self.batches: list[int] = []

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.05, max_concurrent_batches=2)
    async def score(self, xs: list[float]) -> list[float]:
        self.batches.append(len(xs))
        await asyncio.sleep(0.01)
        return [x * self.factor for x in xs]

    @serve.batch(max_batch_size=2)
    async def stream(self, xs: list[float]):
        yield xs

    async def plain(self, x: float) -> float:
        return x


class FakeLimiter:
    kind = "fake"

    def __init__(self) -> None:
        self.grants: list[int | None] = []
        self.released = 0

    def set_grant(self, grant_bytes: int | None) -> None:
        self.grants.append(grant_bytes)

    def reassert(self) -> str:
        return ""

    def release_caches(self) -> None:
        self.released += 1

    def read(self) -> None:
        return None


@pytest.fixture(autouse=True)
def _outside_serve(monkeypatch):
    from ray.serve import batching

    # Ray 2.60's batch queue asks the replica context for max_ongoing_requests (a warning only)
    monkeypatch.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)


def test_batch_methods_are_the_serve_batch_ones_inherited_included():
    class Sub(Scorer):
        pass

    assert sorted(batch_methods(Sub)) == ["score", "stream"]


def test_the_decorator_subclasses_and_leaves_the_users_class_alone():
    busy = managed("scorer", config_text=CONFIG)(Scorer)
    other = managed("other", config_text=CONFIG)(Scorer)
    assert busy is not Scorer and issubclass(busy, Scorer) and busy.__name__ == "Scorer"
    assert (busy.gpubroker_model, other.gpubroker_model) == ("scorer", "other")
    assert busy.score is not Scorer.score and busy.score is not other.score  # a batcher of its own
    assert busy.stream is Scorer.stream  # a streaming batch method is sized, not counted
    assert busy.score._get_max_batch_size() == 4 and busy.score._get_batch_wait_timeout_s() == 0.05


def test_a_config_without_the_model_is_refused_when_decorating():
    with pytest.raises(ValueError, match=r"has no model 'nosuch' \(models: scorer, other\).*add models.nosuch"):
        managed("nosuch", config_text=CONFIG)
    with pytest.raises(ValueError, match="cannot read config"):
        managed("scorer", config="/nonexistent/fleet.yaml")
    with pytest.raises(TypeError, match="takes a class"):
        managed("scorer", config_text=CONFIG)(lambda: None)  # type: ignore[arg-type]


def test_calibration_comes_from_the_profile_or_the_measured_weights():
    spec = model_spec(parse_config_text(CONFIG), "scorer", "test")
    assert calibration_of(spec, 5 * MIB) == {
        "weights_bytes": 32 * MIB,
        "bytes_per_item": 8.0 * MIB,
        "cost_unit": "requests",
    }
    other = model_spec(parse_config_text(CONFIG), "other", "test")
    assert calibration_of(other, 5 * MIB) == {"weights_bytes": 5 * MIB, "cost_unit": "requests"}


def _replica(cls: type, link_handle, limiter: FakeLimiter) -> tuple[object, ManagedReplica]:
    spec = model_spec(parse_config_text(CONFIG), "scorer", "test")
    settings = ModelSettings("scorer", 0, 4, 0.05, spec.quota.base)
    link = BrokerLink("scorer", "r1", lambda: link_handle, rpc_timeout_s=5.0)
    state = ManagedReplica(
        spec,
        link,
        batch_methods(cls),
        limiter=limiter,
        read_memory=lambda: 3 * MIB,
        settings=settings,
    )
    instance = cls.__new__(cls)  # the managed __init__ starts a replica (Ray): the user's alone here
    Scorer.__init__(instance, 2.0)
    setattr(instance, STATE_ATTR, state)
    return instance, state


def test_calls_and_batches_are_counted_and_the_cap_is_the_brokers():
    cls = managed("scorer", config_text=CONFIG)(Scorer)
    limiter = FakeLimiter()

    async def run():
        instance, state = _replica(cls, None, limiter)
        state.apply(ModelSettings("scorer", 1, 3, 0.05, 300 * MIB), first=True)
        out = await asyncio.gather(*(instance.score(float(i)) for i in range(9)))
        return instance, state, out

    instance, state, out = asyncio.run(run())
    assert out == [2.0 * i for i in range(9)]  # each call its own answer
    assert max(instance.batches) == 3 and sum(instance.batches) == 9  # the broker's cap, not the class's 4
    assert cls.score._get_max_batch_size() == 3 and cls.score._get_batch_wait_timeout_s() == 0.05
    assert cls.stream._get_max_batch_size() == 3  # a streaming batch method takes the cap too
    d = state.link.delta
    assert (d.arrivals, d.completions, d.errors) == (9, 9, 0) and len(d.latency_ms) == 9
    assert d.batch_requests == instance.batches and all(ms >= 10.0 for _, ms in d.batches)
    assert state.waiting == 0
    assert limiter.grants == [150 * MIB]  # the model's grant split over its 2 replicas


def test_a_grant_goes_to_the_limit_only_when_it_changes():
    limiter = FakeLimiter()
    _, state = _replica(managed("scorer", config_text=CONFIG)(Scorer), None, limiter)
    state.apply(ModelSettings("scorer", 1, 8, 0.01, 256 * MIB))  # the grant as it was: no limit set
    state.apply(ModelSettings("scorer", 2, 16, 0.02, 400 * MIB, release_cache=True))
    assert limiter.grants == [200 * MIB] and limiter.released == 1


def test_a_report_round_trip_with_the_broker(tmp_path):
    core = BrokerCore(CONFIG, capacity_bytes=1024 * MIB, checkpoint=tmp_path / "ckpt.json")
    limiter = FakeLimiter()
    cls = managed("scorer", config_text=CONFIG)(Scorer)

    async def run():
        instance, state = _replica(cls, CoreLink(core), limiter)
        spec = model_spec(parse_config_text(CONFIG), "scorer", "test")
        cal = calibration_of(spec, 0)
        await asyncio.gather(*(instance.score(1.0) for i in range(6)))
        return await state.report_once(cal), state

    ok, state = asyncio.run(run())
    assert ok and state.link.registered
    core.tick()  # the broker's window reads the report
    status = core.status()["models"]["scorer"]
    assert status["calibrated"] and status["used_bytes"] == 3 * MIB
    assert state.settings.version >= 1 and cls.score._get_max_batch_size() == state.settings.max_batch_size
