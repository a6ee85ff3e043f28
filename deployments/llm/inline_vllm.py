"""vLLM's ``LLMEngine`` in the replica's own process, stepped on one thread, behind ``AsyncLLM``'s calls.

Why: a KV cache of another size means a new vLLM engine. ``AsyncLLM`` runs its engine core in a
spawned process, and on CPU vLLM's executor spawns one more for the worker, so each resize pays two
imports of torch and vLLM; in the replica's process a resize is a model load and a cache allocation
(``python -m bench.vllm_restart`` measures both; ``bench/results/2026-12-05-vllm-restart/``). On a GPU the separate engine
core overlaps scheduling with the model's step, and sleep mode frees an idle cache without a
restart, so ``VllmEngineOptions.in_process`` defaults to this driver on CPU only.

The engine belongs to the step thread: the event loop hands it requests, aborts and calls through a
queue, and gets each step's outputs back with ``call_soon_threadsafe``. vLLM keeps its forward
context and its process groups in module globals, so two engines in one process (a test's two; a
replica has one, and so has each of the benchmark's engine processes) build, step and stop one at a
time under ``VLLM_LOCK``: two unserialised step threads crashed the process (``munmap_chunk():
invalid pointer``). An engine's shutdown tears those groups down (``cleanup_dist_env_and_memory``);
the engines still running in the process get them back at once (one process, world size 1), or
their next step fails ("pipeline model parallel group is not initialized").
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from itertools import count
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the step thread blocks for a command when nothing runs
_INIT_FILES = count()


class FairLock:
    """A lock taken in arrival order, so two engines' step threads alternate: ``threading.Lock``
    lets the thread that releases it take it straight back. (Suspected of starving the second of
    two engines; measured, that slowdown was the offered load, the same with either lock.)"""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket that holds the lock

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            self._cond.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


VLLM_LOCK = FairLock()  # one engine of this process in vLLM at a time (see the module note)


def restore_process_groups(vllm_config: Any) -> None:
    """vLLM's process groups for one process of world size 1, as its CPU worker makes them."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    init_file = Path(tempfile.gettempdir()) / f"gpubroker-vllm-dist-{os.getpid()}-{next(_INIT_FILES)}"
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"file://{init_file}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)


def freeze_heap() -> None:
    """Collect what is not frozen and freeze the heap before vLLM builds an engine.

    vLLM's build collects the heap five times (the model loader, its memory accounting); frozen
    first, those collections scan only what the build makes. After a shutdown (``collect_heap``)
    the rest is frozen already, so this collection scans little; the first build's scans the heap."""
    import gc

    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@contextmanager
def heap_kept_frozen() -> Iterator[None]:
    """vLLM's shutdown as if the heap stayed frozen: its worker and its engine core each unfreeze
    the whole heap and collect it in full (``gc.unfreeze()``, then ``gc.collect()``), and the next
    build's ``freeze_heap`` collected it a third time: about 0.34 s a scan of the 706,000 objects of a
    replica's heap, 1.0 s of a 1.9 s restart (profiled, 2026-12-05), every scan holding the GIL
    while the event loop takes requests. Inside this, their unfreeze does nothing, so their
    collections scan only the engine's own objects (built after the freeze); ``collect_heap``
    then scans the heap once. Callers hold ``VLLM_LOCK``."""
    import gc

    real = gc.unfreeze
    gc.unfreeze = _keep_frozen
    try:
        yield
    finally:
        gc.unfreeze = real


def _keep_frozen() -> None:
    """Stands in for ``gc.unfreeze`` inside ``heap_kept_frozen``."""


def collect_heap() -> None:
    """Unfreeze, collect and freeze again: the one full scan a restart pays. What died in cycles with
    frozen objects since the last freeze (request state frozen mid-flight) is freed here, as vLLM's
    own unfreeze would free it, so nothing piles up in the frozen generation restart after restart."""
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Once: give the interpreter's last collection the whole heap at exit (a heap left frozen kept
    nanobind's objects from its finaliser, which printed "nanobind: leaked 514 functions")."""
    import gc

    atexit.register(gc.unfreeze)


class EngineDead(RuntimeError):
    """The in-process engine's step thread ended (an exception in vLLM, or shutdown)."""


class InlineLLM:
    """The calls ``VllmEngine`` makes of ``AsyncLLM`` (generate, sleep, wake_up, shutdown, errored)."""

    live: list[InlineLLM] = []  # engines of this process built and not yet shut down (under VLLM_LOCK)

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[Any]] = {}  # event-loop thread only
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-inline-step", daemon=True)
        with VLLM_LOCK:
            InlineLLM.live.append(self)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: Any, stat_loggers: list[Any], loop: asyncio.AbstractEventLoop) -> InlineLLM:
        """Build vLLM's engine in this process (blocking: call it off the event loop)."""
        from vllm.v1.engine.llm_engine import LLMEngine

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
        # our stat logger only: vLLM adds its periodic log line when this logger is at INFO
        logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        args.disable_log_stats = False  # the stat loggers are called only when stats are on
        with VLLM_LOCK:
            freeze_heap()
            engine = LLMEngine.from_engine_args(args, stat_loggers=stat_loggers)
        return cls(engine, loop)

    @property
    def vllm_config(self) -> Any:
        """vLLM's resolved config (dtypes, cache), as ``AsyncLLM.vllm_config``."""
        return self._engine.vllm_config

    @property
    def errored(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    # ------------------------------------------------------------------ the event loop's side

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """vLLM's outputs for one request; cancelling the iteration aborts it."""
        if self.errored:
            raise EngineDead(f"vLLM's in-process engine has stopped: {self._error!r}")
        stream: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, params))
        done = False
        try:
            while not done:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                done = bool(out.finished)
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._inbox.put(("abort", request_id))

    async def sleep(self, level: int = 1) -> None:
        await self._call(lambda engine: engine.sleep(level))

    async def wake_up(self) -> None:
        await self._call(lambda engine: engine.wake_up())

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        done: Future[Any] = Future()
        self._inbox.put(("call", fn, done))
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        """Stop stepping and free the engine (blocking: the thread is joined); a second call does nothing."""
        if self._engine is None:
            return
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join()
        with VLLM_LOCK:
            with heap_kept_frozen():
                self._engine.engine_core.shutdown()
            InlineLLM.live.remove(self)
            if InlineLLM.live:
                restore_process_groups(InlineLLM.live[0]._engine.vllm_config)
            self._engine = None
            collect_heap()
        if self._error is None:
            self._error = EngineDead("vLLM's in-process engine was shut down")
        self._post(self._fail_all, self._error)

    def _deliver(self, outputs: list[Any]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ the step thread's side

    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stop.is_set():
                self._take_commands(engine, block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests() and not self._stop.is_set():
                    with VLLM_LOCK:
                        outputs = engine.step()
                    if outputs:
                        self._post(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - every waiting stream is told, then the replica's health check
            logger.exception("vLLM's in-process engine failed")
            self._error = exc
            self._post(self._fail_all, EngineDead(f"vLLM's in-process engine failed: {exc!r}"))

    def _take_commands(self, engine: Any, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                self._do(engine, command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _do(self, engine: Any, command: tuple[Any, ...]) -> None:
        with VLLM_LOCK:
            self._do_locked(engine, command)

    def _do_locked(self, engine: Any, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params = command
            try:
                engine.add_request(request_id, prompt, params)
            except Exception as exc:  # noqa: BLE001 - vLLM refused this request: only its stream fails
                self._post(self._fail, request_id, exc)
        elif kind == "abort":
            engine.abort_request([command[1]])
        elif kind == "call":
            _, fn, done = command
            try:
                done.set_result(fn(engine))
            except Exception as exc:  # noqa: BLE001 - the caller awaits the exception
                done.set_exception(exc)
