"""The in-process vLLM driver's thread and queues, on a fake engine (pure unit tests: no vLLM).

The fake takes requests, yields one output per step per request and finishes each after its
``n`` steps; it can be told to fail a step or refuse a request. vLLM itself behind this driver is
tested in ``tests/unit/test_llm_engine.py`` (``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from dataclasses import dataclass

import pytest

from gpubroker.deployments.llm.inline_vllm import EngineDead, InlineLLM


@dataclass
class Out:
    request_id: str
    step: int
    finished: bool


class FakeCore:
    def __init__(self):
        self.shut = False

    def shutdown(self):
        self.shut = True


class FakeEngine:
    def __init__(self, fail_on_step: int | None = None):
        self.left: dict[str, int] = {}
        self.steps = 0
        self.aborted: list[str] = []
        self.fail_on_step = fail_on_step
        self.engine_core = FakeCore()
        self.thread_names: set[str] = set()

    def add_request(self, request_id, prompt, params):
        self.thread_names.add(threading.current_thread().name)
        if prompt == "refuse":
            raise ValueError("prompt refused")
        self.left[request_id] = int(params)

    def abort_request(self, ids):
        for rid in ids:
            self.aborted.append(rid)
            self.left.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        self.steps += 1
        self.thread_names.add(threading.current_thread().name)
        if self.fail_on_step == self.steps:
            raise RuntimeError("boom in step")
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            outs.append(Out(rid, self.steps, self.left[rid] == 0))
            if self.left[rid] == 0:
                del self.left[rid]
        return outs

    def sleep(self, level):
        self.slept = (level, threading.current_thread().name)


async def collect(llm, rid, n, prompt="p"):
    return [o async for o in llm.generate(prompt, n, rid)]


def run(coro):
    return asyncio.run(coro)


def test_outputs_arrive_in_order_and_the_engine_is_only_touched_by_the_step_thread():
    async def body():
        fake = FakeEngine()
        llm = InlineLLM(fake, asyncio.get_running_loop())
        a, b = await asyncio.gather(collect(llm, "a", 3), collect(llm, "b", 5))
        llm.shutdown()
        return fake, a, b

    fake, a, b = run(body())
    assert [o.finished for o in a] == [False, False, True] and len(b) == 5
    assert [o.step for o in b] == sorted(o.step for o in b)
    assert fake.thread_names == {"vllm-inline-step"} and fake.engine_core.shut


def test_a_cancelled_request_is_aborted_in_the_engine():
    async def body():
        fake = FakeEngine()
        llm = InlineLLM(fake, asyncio.get_running_loop())
        task = asyncio.create_task(collect(llm, "long", 10**9))
        while fake.steps < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        while not fake.aborted:
            await asyncio.sleep(0.01)
        llm.shutdown()
        return fake

    fake = run(body())
    assert fake.aborted == ["long"] and not fake.left


def test_a_refused_request_fails_alone():
    async def body():
        llm = InlineLLM(FakeEngine(), asyncio.get_running_loop())
        bad, good = await asyncio.gather(
            collect(llm, "bad", 2, prompt="refuse"), collect(llm, "ok", 2), return_exceptions=True
        )
        alive = not llm.errored
        llm.shutdown()
        return bad, good, alive

    bad, good, alive = run(body())
    assert isinstance(bad, ValueError) and "refused" in str(bad)
    assert len(good) == 2 and alive


def test_a_failing_step_fails_every_stream_and_marks_the_engine_errored():
    async def body():
        llm = InlineLLM(FakeEngine(fail_on_step=2), asyncio.get_running_loop())
        got = await asyncio.gather(collect(llm, "a", 5), collect(llm, "b", 5), return_exceptions=True)
        with pytest.raises(EngineDead):
            await collect(llm, "c", 1)
        errored = llm.errored
        llm.shutdown()
        return got, errored

    got, errored = run(body())
    assert all(isinstance(g, EngineDead) and "boom in step" in str(g) for g in got)
    assert errored


def test_shutdown_fails_what_is_still_waiting_and_calls_run_on_the_step_thread():
    async def body():
        fake = FakeEngine()
        llm = InlineLLM(fake, asyncio.get_running_loop())
        await llm.sleep(1)
        slept = fake.slept
        task = asyncio.create_task(collect(llm, "long", 10**9))
        while fake.steps < 2:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(llm.shutdown)
        llm.shutdown()  # a second shutdown does nothing
        return slept, await asyncio.gather(task, return_exceptions=True), llm.errored

    slept, (res,), errored = run(body())
    assert slept == (1, "vllm-inline-step")
    assert isinstance(res, EngineDead) and errored


class UnfreezingCore:
    """Shuts down as vLLM's worker and engine core do: unfreeze the heap, then collect it."""

    def __init__(self):
        self.frozen_at_collect = -1

    def shutdown(self):
        gc.unfreeze()
        self.frozen_at_collect = gc.get_freeze_count()
        gc.collect()


class Cycle:
    pass


def test_shutdown_keeps_the_heap_frozen_through_vllms_unfreeze_then_scans_it_once():
    """vLLM's two unfreeze-and-collect passes scan only what is not frozen; the driver then unfreezes,
    collects and freezes once, which frees a cycle that died frozen (request state frozen mid-flight)
    and leaves gc.unfreeze as it was."""

    async def body():
        fake = FakeEngine()
        core = fake.engine_core = UnfreezingCore()
        junk = Cycle()
        junk.me = junk
        ref = weakref.ref(junk)
        gc.freeze()  # junk alive at a build's freeze
        del junk
        llm = InlineLLM(fake, asyncio.get_running_loop())
        await asyncio.to_thread(llm.shutdown)
        return core.frozen_at_collect, ref

    real_unfreeze = gc.unfreeze
    try:
        frozen_at_collect, ref = run(body())
        assert frozen_at_collect > 0  # vLLM's unfreeze did nothing
        assert ref() is None  # the one full scan freed the frozen cycle
        assert gc.unfreeze is real_unfreeze and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
