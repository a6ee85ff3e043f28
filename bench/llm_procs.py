"""The LLM benchmark's engines, each in a process of its own, and the broker as its Ray actor: as a fleet runs them.

Why processes: in one process vLLM's module globals make every engine build, step and stop one at a
time under one lock (``deployments/llm/inline_vllm.py``), so a restart of any engine (an idle lender
shrinking its cache, about 3 s) stopped every other engine too, the bursting one included. A fleet
runs each engine in a Serve replica of its own, where a lender's restart costs the lender; the
benchmark's engines now run that way, as Ray actors (``EngineProc``) reporting to a
``gpubroker.broker.actor.BrokerActor`` over the same link a replica uses (``gpubroker.deployments.llm.report_loop``).
The arms' requests are replayed inside each engine's process (``bench.llm_replay.replay``), timed
from one ``t0`` on ``time.perf_counter``, the node's monotonic clock, which every process reads alike.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from bench.llm_replay import engine_delta, replay, reset

ROOT = Path(__file__).resolve().parents[1]  # the repository: the actors import bench/ from here


def ray_up() -> None:
    """A local Ray for the benchmark (the engines' and the broker's processes), once."""
    if ray.is_initialized():
        return
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    # Each engine keeps Ray's one OpenMP thread (OMP_NUM_THREADS=1 for an actor of num_cpus=0); the
    # actors' logs (vLLM's warnings, the broker's decisions) stay in Ray's session logs.
    ray.init(include_dashboard=False, logging_level="WARNING", log_to_driver=False, runtime_env={"env_vars": env})


def engine_reporter(name: str, engine: Any, get_handle: Any) -> Any:
    """The replica's report loop for one engine (``EngineReporter``), its idle time counted here."""
    from gpubroker.deployments.llm.report_loop import EngineReporter, engine_link
    from gpubroker.deployments.llm.server import engine_report

    idle_since = [time.monotonic()]

    def report() -> Any:
        st = engine.stats()
        if st.running or st.waiting:
            idle_since[0] = time.monotonic()
        return engine_report(engine, time.monotonic() - idle_since[0], name)

    link = engine_link(name, f"{name}-bench", get_handle, 0.5)
    return EngineReporter(engine, link, report_interval_s=0.5, engine_report=report)


class CountedEngine:
    """The engine as the replica's server hands it requests: each counted in the report link, an
    arrival when submitted and a completion (or an error) when it ends, so the broker sees the
    rates a fleet's broker sees (without them every engine reported no arrivals)."""

    def __init__(self, engine: Any, reporter: Any):
        self.engine, self.reporter = engine, reporter

    def submit(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> AsyncIterator[Any]:
        self.reporter.arrived()
        return counted(self.engine.submit(request_id, prompt_ids, max_tokens), self.reporter, time.monotonic())


async def counted(stream: AsyncIterator[Any], reporter: Any, started_s: float) -> AsyncIterator[Any]:
    from gpubroker.deployments.llm.server import FAILED

    async for delta in stream:
        if delta.finished:
            reporter.finished((time.monotonic() - started_s) * 1000.0, delta.finish_reason not in FAILED)
        yield delta


@ray.remote(num_cpus=0)
class EngineProc:
    """One ``VllmEngine`` in its own process: an arm's start (bounds, cache, the broker link), its
    requests, and what vLLM did during it."""

    def __init__(self, name: str, options: dict[str, Any]):
        self.name = name
        self.options = options
        self.engine: Any = None
        self.before: Any = None
        self.reporter: Any = None
        self.reporting: asyncio.Task | None = None

    async def start(self) -> None:
        from gpubroker.deployments.llm.vllm_engine import VllmEngine, VllmEngineOptions

        self.engine = VllmEngine(VllmEngineOptions(**self.options))
        await self.engine.start()

    async def begin(self, seqs: int | None, broker: Any | None) -> None:
        """Back to the arm's start (``seqs``: a static max_num_seqs); with ``broker``, report to it."""
        e = self.engine
        await reset(e, e.options)
        if seqs is not None:
            e.set_bounds(seqs, e.options.max_batched_tokens, False)
        self.before = e.stats()
        self.reporter = None
        if broker is not None:
            self.reporter = engine_reporter(self.name, e, lambda: broker)
            await self.reporter.report_once()
            self.reporting = asyncio.create_task(self.reporter.run())

    async def replay(self, reqs: list[Any], t0: float, until_s: float) -> list[Any]:
        engine = self.engine if self.reporter is None else CountedEngine(self.engine, self.reporter)
        return await replay({self.name: engine}, {self.name: reqs}, t0, until_s)

    async def end(self) -> dict[str, Any]:
        """Stop reporting; what vLLM did since ``begin`` (``bench.llm_replay.engine_delta``)."""
        if self.reporting is not None:
            self.reporting.cancel()
            await asyncio.gather(self.reporting, return_exceptions=True)
            self.reporting = None
        return engine_delta(self.before, self.engine.stats())

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()


async def start_engines(names: tuple[str, ...], options: Any) -> dict[str, Any]:
    """An ``EngineProc`` per name, all started (their vLLM loaded) before this returns."""
    procs = {n: EngineProc.remote(n, asdict(options)) for n in names}
    await asyncio.gather(*(p.start.remote() for p in procs.values()))
    return procs


async def stop_engines(procs: dict[str, Any]) -> None:
    await asyncio.gather(*(p.stop.remote() for p in procs.values()), return_exceptions=True)
    for p in procs.values():
        stop_actor(p)


def stop_actor(handle: Any) -> None:
    ray.kill(handle)


async def start_broker_actor(config_text: str) -> Any:
    """A ``BrokerActor`` of its own for one arm (no name, no exporter, a fresh checkpoint)."""
    from gpubroker.broker.actor import RemoteBroker

    path = Path(tempfile.mkdtemp(prefix="gpubroker-bench-llm-")) / "broker.ckpt"
    handle = RemoteBroker.options(num_cpus=0, max_concurrency=64).remote(config_text, None, str(path), None)
    await handle.ping.remote()
    return handle
