"""The batched model deployment: one Serve replica of one model.

Per request (``infer``): admission (paused? queue over ``max_queued``? body over
``max_body_bytes``?) and input validation (``adapter.validate``) happen before anything
touches the model; each item then goes through Ray Serve's own ``@serve.batch`` (with a
``batch_size_fn`` that counts ``adapter.cost`` for token-priced models). A request still
queued after ``request_timeout_s`` gets an explicit timeout (its items leave the queue).

Per batch (the fast loop): read memory headroom from the probe; below
``gpu.emergency_free_frac`` halve the local batch cap at once (never below the floor), pause
admission if it stays critical, count the event; widen back step by step when headroom
returns. The model runs through ``deployments.oom.split_retry``: an OOM splits the batch in
two and retries each half, so no request is lost to an OOM.

Per report interval: ONE ``StatsReport`` delta to the broker (``ray.get_actor(name,
namespace=...)``, async, never on a request's path); the ``ModelSettings`` in the reply are
applied when their version changes (``set_max_batch_size``, ``set_batch_wait_timeout_s``,
``probe.enforce`` and ``adapter.set_memory_limit`` with this replica's share of the grant).
If the broker is unreachable the replica keeps serving on its last settings and retries.

Results of ``infer`` are plain dicts with an HTTP-like ``status`` (200/413/422/503/504/500)
so the ingress maps them without depending on exception types crossing processes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from broker.types import ModelSettings, StatsReport
from quotas.config import FleetConfig, ModelSpec, parse_config_text

logger = logging.getLogger("ray.serve")

MAX_LATENCY_SAMPLES = 2000  # per report; a uniform sample beyond that
RECOVER_STEP_FRAC = 0.125  # fast loop widens the cap back by this share of the broker's cap per batch
CRITICAL_FREE_FACTOR = 0.5  # below emergency_free_frac x this at the floor: pause admission


def max_ongoing_for(spec: ModelSpec) -> int:
    """max_ongoing_requests >= largest batch x max_concurrent_batches (and room for the queue)."""
    return max(spec.batch.ceiling * spec.batch.max_concurrent_batches, spec.max_queued) + spec.batch.max_concurrent_batches


def initial_settings(name: str, spec: ModelSpec) -> ModelSettings:
    """What a replica runs before the broker has answered (version 0)."""
    return ModelSettings(
        model=name,
        version=0,
        max_batch_size=spec.batch.initial_cap,
        batch_wait_timeout_s=spec.wait.initial_s,
        grant_bytes=spec.quota.base,
        admit=True,
        max_ongoing_requests=max_ongoing_for(spec),
    )


class _Item:
    """One input on its way through Serve's batcher."""

    __slots__ = ("value", "cost", "owner", "let_in")

    def __init__(self, value: Any, cost: int, owner: "ModelReplica"):
        self.value = value
        self.cost = cost
        self.owner = owner
        self.let_in = False  # counted in the replica's let-in-not-running cost (lazy gate)


def batch_cost(items: list) -> int:
    """``batch_size_fn`` for token-priced models: the batch's total cost.

    An item costlier than the whole cap counts as the cap, so it runs alone instead of being
    refused by Serve's batcher ("Size of item is greater than max_batch_size").
    """
    total = 0
    for item in items:
        total += min(item.cost, max(1, item.owner.cap))
    return total


@dataclass
class _Delta:
    """Counters since the last report that reached the broker."""

    started_s: float
    arrivals: int = 0
    completions: int = 0
    rejections: int = 0
    timeouts: int = 0
    errors: int = 0
    latency_ms: list[float] = field(default_factory=list)
    latency_seen: int = 0
    batches: list[tuple[float, float]] = field(default_factory=list)
    batch_requests: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    mem_peak_bytes: int = 0
    oom_splits: int = 0
    emergency_shrinks: int = 0

    def add_latency(self, ms: float) -> None:
        self.latency_seen += 1
        if len(self.latency_ms) < MAX_LATENCY_SAMPLES:
            self.latency_ms.append(ms)
        else:  # reservoir sample: every completion equally likely to be kept
            j = random.randrange(self.latency_seen)
            if j < MAX_LATENCY_SAMPLES:
                self.latency_ms[j] = ms

    def merge(self, older: "_Delta") -> None:
        """Fold an unsent older delta into this one (the broker was unreachable)."""
        self.started_s = min(self.started_s, older.started_s)
        for name in ("arrivals", "completions", "rejections", "timeouts", "errors", "oom_splits", "emergency_shrinks"):
            setattr(self, name, getattr(self, name) + getattr(older, name))
        for ms in older.latency_ms:
            self.add_latency(ms)
        keep = 512
        self.batches = (older.batches + self.batches)[-keep:]
        self.batch_requests = (older.batch_requests + self.batch_requests)[-keep:]
        self.busy_s += older.busy_s
        self.mem_peak_bytes = max(self.mem_peak_bytes, older.mem_peak_bytes)


def _error(status: int, detail: str, **extra: Any) -> dict[str, Any]:
    return {"status": status, "detail": detail, **extra}


class ModelReplica:
    """Serve deployment class; ``deployments.app`` binds one per model (named as the model)."""

    async def __init__(self, model_name: str, config_text: str):
        from ray import serve

        self._t0 = time.time()
        cfg: FleetConfig = parse_config_text(config_text, "deployment config")
        if model_name not in cfg.models:
            raise ValueError(f"model '{model_name}' is not in the config; known: {', '.join(cfg.models)}")
        self.name = model_name
        self.cfg = cfg
        self.spec: ModelSpec = cfg.models[model_name]
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            self.replica_id = f"{model_name}-{os.getpid()}"
        self.settings = initial_settings(model_name, self.spec)
        self.cap = self.settings.max_batch_size  # local cap: broker's, halved by the fast loop
        self.paused = False  # fast-loop pause (memory critical)
        self.waiting = 0  # requests admitted and not answered yet
        self.delta = _Delta(time.time())
        self.seq = 0
        self.broker = None
        self.registered = False
        self.broker_failures = 0
        self.last_broker_ok_s: float | None = None
        self.mem_used_bytes = 0
        self.device_free_frac: float | None = None
        self.sm_util_frac: float | None = None
        self.calibration: dict[str, Any] = {}
        self.token_priced = False
        # Lazy formation (see _admit_to_batcher): requests wait at a gate while the executor is
        # busy and enter Serve's batcher together when it frees. On unless the model is pinned
        # static, or the config says the runtime's own formation is to be left alone.
        self.lazy_gate = self.spec.control.strategy != "static" and cfg.broker.batch_formation == "lazy"
        self._running = 0  # batches executing
        self._released = 0  # cost let into Serve's batcher and not running yet (forming)
        self._form_until = 0.0  # monotonic end of the forming batch's wait window
        self._gate: deque[tuple[asyncio.Future, _Item]] = deque()  # FIFO of (waiter, item) held back
        # Batches never overlap inside one adapter. Validation runs in a worker thread beside a
        # running batch and is NOT under this lock: holding it would keep new requests out of
        # Serve's queue for a whole batch, so the next batch would form from almost nothing.
        # Adapters make validate/cost safe beside predict (minilm locks its tokenizer only).
        self._model_lock = threading.Lock()
        await asyncio.to_thread(self._load)
        self._batch = serve.batch(
            max_batch_size=self.cap,
            batch_wait_timeout_s=self.settings.batch_wait_timeout_s,
            max_concurrent_batches=self.spec.batch.max_concurrent_batches,
            batch_size_fn=batch_cost if self.token_priced else None,
        )(self._run_batch)
        self._enforce(self.settings)
        await self._register()
        self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    # ------------------------------------------------------------------ start-up
    def _load(self) -> None:
        from broker.probes import detect_capacity, detect_device, make_probe
        from deployments.models import load_adapter

        try:
            import torch  # noqa: F401 - the runtime is per-process overhead, not the model's
        except ImportError:
            pass
        self.device = detect_device(self.cfg.gpu.device)
        capacity = self.cfg.gpu.capacity_bytes or detect_capacity(self.device)
        self.probe = make_probe(self.device, capacity)
        self.on_cuda = self.device.startswith("cuda")
        # On cpu, memory is host RSS: what this process held before the model counts like a
        # CUDA context (overhead), not against the model's quota.
        self.baseline_bytes = 0 if self.on_cuda else self.probe.read().process_bytes
        self.adapter = load_adapter(self.spec.model, self.spec.options, self.device)
        self.token_priced = getattr(self.adapter, "cost_unit", "requests") == "tokens" or self.spec.batch.unit == "tokens"
        self.calibration = self._calibrate()
        self._read_memory()
        if not self.on_cuda:
            # Host quota: what is measured against the grant is this process's resident memory
            # over its pre-model baseline (weights plus runtime, tokenizer, allocator pools),
            # so the memory model's fixed part is that footprint, not just the parameters.
            params = int(self.calibration.get("weights_bytes", 0) or 0)
            self.calibration["weights_bytes"] = max(params, int(self.mem_used_bytes))
            self.calibration["parameter_bytes"] = params
        logger.info(
            "gpubroker replica %s/%s loaded on %s in %.1fs: %s",
            self.name, self.replica_id, self.device, time.time() - self._t0, self.calibration,
        )

    def _calibrate(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cost_unit": "tokens" if self.token_priced else "requests"}
        try:
            from deployments.calibration import calibrate
        except ImportError:
            calibrate = None
        if calibrate is not None:
            try:
                result = calibrate(self.adapter, self.probe, device=self.device)
                data = result.to_dict() if hasattr(result, "to_dict") else dict(result)
                out.update(data)
                return out
            except Exception as exc:  # noqa: BLE001 - serve uncalibrated rather than not at all
                logger.warning("gpubroker: calibration of %s failed (%r); using declared sizes", self.name, exc)
        declared = self.adapter.declared_memory()
        if declared is not None:
            out["weights_bytes"], out["bytes_per_unit"] = int(declared[0]), float(declared[1])
        else:
            out["weights_bytes"], out["bytes_per_unit"] = int(self.adapter.weights_bytes()), 0.0
        return out

    async def _register(self) -> None:
        try:
            broker = self._broker_handle()
            reply = await asyncio.wait_for(
                broker.register.remote(self.name, self.replica_id, self.calibration), timeout=self._rpc_timeout_s()
            )
            self.registered = True
            self._apply(reply)
            self._broker_ok()
        except Exception as exc:  # noqa: BLE001 - serve on config settings, retry from the report loop
            self._broker_failed(exc, "register")

    # ------------------------------------------------------------------ broker link
    def _rpc_timeout_s(self) -> float:
        return max(2.0, 4.0 * self.cfg.broker.report_interval_s)

    def _broker_handle(self):
        if self.broker is None:
            import ray

            self.broker = ray.get_actor(self.cfg.broker.name, namespace=self.cfg.broker.namespace)
        return self.broker

    def _broker_ok(self) -> None:
        self.last_broker_ok_s = time.time()
        self.broker_failures = 0

    def _broker_failed(self, exc: BaseException, what: str) -> None:
        self.broker_failures += 1
        self.broker = None  # look the actor up again next time (it may have been re-created)
        if self.broker_failures in (1, 10) or self.broker_failures % 100 == 0:
            logger.warning(
                "gpubroker replica %s: broker %s failed (%d in a row, %r); serving on settings v%d",
                self.name, what, self.broker_failures, exc, self.settings.version,
            )

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.broker.report_interval_s)
            try:
                await self.report_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("gpubroker replica %s: report loop error", self.name)

    def build_report(self, delta: _Delta, now: float) -> StatsReport:
        return StatsReport(
            model=self.name,
            replica_id=self.replica_id,
            seq=self.seq,
            now_s=now,
            interval_s=max(1e-3, now - delta.started_s),
            arrivals=delta.arrivals,
            completions=delta.completions,
            rejections=delta.rejections,
            timeouts=delta.timeouts,
            errors=delta.errors,
            latency_ms=tuple(round(x, 3) for x in delta.latency_ms),
            batches=tuple(delta.batches),
            batch_requests=tuple(delta.batch_requests),
            busy_s=delta.busy_s,
            queue_depth=self.waiting,
            mem_used_bytes=self.mem_used_bytes,
            mem_peak_bytes=max(delta.mem_peak_bytes, self.mem_used_bytes),
            device_free_frac=self.device_free_frac,
            sm_util_frac=self.sm_util_frac,
            oom_splits=delta.oom_splits,
            emergency_shrinks=delta.emergency_shrinks,
            settings_version=self.settings.version,
        )

    async def report_once(self) -> bool:
        """Send the delta since the last report; apply the settings in the reply."""
        if not self.registered:
            await self._register()
            if not self.registered:
                return False
        now = time.time()
        self._read_memory()
        delta, self.delta = self.delta, _Delta(now)
        report = self.build_report(delta, now)
        try:
            broker = self._broker_handle()
        except Exception as exc:  # noqa: BLE001 - no broker: keep the counts for the next try
            self.delta.merge(delta)
            self._broker_failed(exc, "lookup")
            return False
        self.seq += 1
        try:
            reply = await asyncio.wait_for(broker.report.remote(report.to_dict()), timeout=self._rpc_timeout_s())
        except asyncio.TimeoutError as exc:
            # The call may still land (the actor retries tasks across restarts): do not resend.
            self._broker_failed(exc, "report (timeout)")
            return False
        except Exception as exc:  # noqa: BLE001 - actor gone: keep the counts for the next try
            self.delta.merge(delta)
            self._broker_failed(exc, "report")
            if "unknown model" in str(exc):
                self.registered = False
            return False
        self._apply(reply)
        self._broker_ok()
        return True

    # ------------------------------------------------------------------ settings
    def _apply(self, reply: dict[str, Any]) -> None:
        new = ModelSettings(**reply)
        if new.version == self.settings.version and self.registered and new == self.settings:
            return
        old = self.settings
        self.settings = new
        self.cap = max(1, new.max_batch_size)
        self._batch.set_max_batch_size(self.cap)
        self._batch.set_batch_wait_timeout_s(max(0.0, new.batch_wait_timeout_s))
        if new.grant_bytes != old.grant_bytes or old.version == 0:
            self._enforce(new)
        if new.admit:
            self.paused = False

    def _grant_per_replica(self, settings: ModelSettings) -> int:
        return max(1, settings.grant_bytes // max(1, self.spec.replicas))

    def _enforce(self, settings: ModelSettings) -> None:
        grant = self._grant_per_replica(settings)
        try:
            # CUDA: set_per_process_memory_fraction (the context counts too); host: recorded.
            self.probe.enforce(grant if self.on_cuda else grant + self.baseline_bytes)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: probe.enforce(%d) failed: %r", self.name, grant, exc)
        try:
            self.adapter.set_memory_limit(grant)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: set_memory_limit(%d) failed: %r", self.name, grant, exc)

    # ------------------------------------------------------------------ fast loop
    def _read_memory(self) -> float | None:
        """Update used bytes and the free share; returns the free share the fast loop uses."""
        try:
            reading = self.probe.read()
        except Exception:  # noqa: BLE001 - no reading: no emergency decisions on it
            return None
        if self.on_cuda:
            self.mem_used_bytes = int(reading.process_bytes)
            free = reading.free_frac
        else:  # host quota: free share of this replica's grant
            self.mem_used_bytes = max(0, int(reading.process_bytes) - self.baseline_bytes)
            grant = self._grant_per_replica(self.settings)
            free = max(0.0, 1.0 - self.mem_used_bytes / grant)
        self.device_free_frac = free
        self.sm_util_frac = reading.sm_util_frac
        self.delta.mem_peak_bytes = max(self.delta.mem_peak_bytes, self.mem_used_bytes)
        return free

    def _fast_loop(self) -> None:
        free = self._read_memory()
        if free is None:
            return
        threshold = self.cfg.gpu.emergency_free_frac
        floor = self.spec.batch.floor
        if free < threshold:
            new_cap = max(floor, self.cap // 2)
            if new_cap < self.cap:
                self.cap = new_cap
                self._batch.set_max_batch_size(new_cap)
                self.delta.emergency_shrinks += 1
                logger.warning("gpubroker replica %s: free %.1f%% < %.1f%%: batch cap -> %d",
                               self.name, 100 * free, 100 * threshold, new_cap)
            elif free < threshold * CRITICAL_FREE_FACTOR or self.cap <= floor:
                if not self.paused:
                    self.delta.emergency_shrinks += 1
                    logger.warning("gpubroker replica %s: free %.1f%% still critical at the floor: admission paused",
                                   self.name, 100 * free)
                self.paused = True
        else:
            self.paused = False
            target = max(1, self.settings.max_batch_size)
            if self.cap < target:
                self.cap = min(target, self.cap + max(1, int(target * RECOVER_STEP_FRAC)))
                self._batch.set_max_batch_size(self.cap)

    async def _run_batch(self, items: list[_Item]) -> list[Any]:
        from deployments.oom import split_retry

        self._fast_loop()
        values = [item.value for item in items]
        cost = sum(item.cost for item in items) if self.token_priced else len(items)

        def on_split(n: int) -> None:  # runs in the worker thread; counts into the current delta
            self.delta.oom_splits += 1

        start = time.perf_counter()
        self._running += 1
        for item in items:  # they run now: no longer pending in the batcher
            self._settle(item)
        try:
            return await asyncio.to_thread(split_retry, self._predict, values, on_split)
        finally:
            exec_s = time.perf_counter() - start
            self._running -= 1
            self._pump()  # lazy formation: what waited meanwhile forms the next batch
            d = self.delta  # the report may have swapped the delta while the batch ran
            d.batches.append((float(cost), exec_s * 1000.0))
            d.batch_requests.append(len(items))
            d.busy_s += exec_s

    def _gate_open(self, cost: int) -> bool:
        """May a request of ``cost`` enter Serve's batcher now?

        Only while a batch slot is free and no batch let in earlier is still waiting to run:
        either nothing is let in yet (this request starts a new batch), or the batch being
        formed is inside its wait window (the broker's ``batch_wait_timeout_s`` from its first
        request) and has room under the cap. A request let in after its batch closed would
        start a batch of its own that queues for the slot, and every later batch would then
        wait one batch longer (a queue of formed batches persists at any load)."""
        if self._running >= self.spec.batch.max_concurrent_batches:
            return False
        if self._released == 0:
            return True
        return time.monotonic() < self._form_until and self._released + cost <= self.cap

    def _let_in(self, item: _Item) -> None:
        if self._released == 0:  # the first request of a new batch opens its wait window
            self._form_until = time.monotonic() + max(0.0, self.settings.batch_wait_timeout_s)
        self._released += int(item.cost)
        item.let_in = True

    def _settle(self, item: _Item) -> None:
        """The item left the batcher's queue: it runs, or it was cancelled (Serve drops a
        cancelled request from its batch without a word, so the gate must count it out here)."""
        if item.let_in:
            item.let_in = False
            self._released = max(0, self._released - int(item.cost))

    def _pump(self) -> None:
        """When the slot frees and nothing let in is pending: let the held requests in, oldest
        first, up to one cap's worth, in this event-loop turn (they form one batch)."""
        if self._running >= self.spec.batch.max_concurrent_batches or self._released > 0:
            return
        while self._gate:
            fut, item = self._gate[0]
            if fut.done():  # its request timed out at the gate
                self._gate.popleft()
                continue
            if self._released > 0 and self._released + int(item.cost) > self.cap:
                return
            self._gate.popleft()
            self._let_in(item)
            fut.set_result(None)

    async def _admit_to_batcher(self, item: _Item) -> Any:
        """Lazy batch formation on Ray 2.60's ``@serve.batch``.

        Serve's batcher closes a batch ``batch_wait_timeout_s`` after its first request and
        queues it for a ``max_concurrent_batches`` slot, then starts the next one at once, busy
        or not: while a long batch runs, arrivals leave in a string of small batches that each
        pay the fixed cost, and a backlog cut into small batches never merges again (a queue
        of formed batches can persist at any load). Here a request waits at a FIFO gate while
        a batch runs; when it finishes, up to one cap's worth of the waiting requests enters
        Serve's queue in the same event-loop turn, so the next batch takes all of them and
        batches grow with the load, as with lazy formation. An idle replica admits at once and
        the broker's own wait applies. A request cancelled at the gate (request timeout) never
        reaches the model.
        """
        if not self.lazy_gate:
            return await self._batch(item)
        try:
            if self._gate or not self._gate_open(int(item.cost)):
                fut: asyncio.Future = asyncio.get_running_loop().create_future()
                self._gate.append((fut, item))
                await fut
            else:
                self._let_in(item)
            return await self._batch(item)
        except asyncio.CancelledError:
            if item.let_in:  # let in, then cancelled before its batch ran
                self._settle(item)
                self._pump()
            raise

    # ------------------------------------------------------------------ requests
    def _validate_all(self, inputs: list) -> list[_Item] | dict[str, Any]:
        """Validated items with their cost, or a 422 naming the field (runs in a worker thread)."""
        from deployments.models import InputError

        items = []
        for i, raw in enumerate(inputs):
            try:
                value = self.adapter.validate(raw)
                cost = int(self.adapter.cost(value)) if self.token_priced else 1
            except InputError as exc:
                where = f"inputs[{i}]" if exc.field == "body" else f"inputs[{i}].{exc.field}"
                return _error(422, f"{where}: {exc.message}", field=where)
            except Exception as exc:  # noqa: BLE001 - a validator bug is still the input's 422, never a crash
                return _error(422, f"inputs[{i}]: {exc}", field=f"inputs[{i}]")
            items.append(_Item(value, max(1, cost), self))
        return items

    def _predict(self, values: list) -> list:
        with self._model_lock:
            return self.adapter.predict(values)

    def _reject(self, n: int, status: int, detail: str, **extra: Any) -> dict[str, Any]:
        self.delta.rejections += n
        return _error(status, detail, **extra)

    async def infer(self, inputs: list, body_bytes: int = 0) -> dict[str, Any]:
        """Run ``inputs`` (a list of items); ``{"status": 200, "outputs": [...]}`` or an error dict."""
        t0 = time.time()
        spec = self.spec
        if not isinstance(inputs, list) or not inputs:
            return _error(422, "inputs must be a non-empty list of items", field="inputs")
        n = len(inputs)
        retry_after = max(1, int(round(self.cfg.broker.control_interval_s)))
        if body_bytes > spec.max_body_bytes:
            return self._reject(n, 413, f"body of {body_bytes} bytes is over max_body_bytes ({spec.max_body_bytes})")
        if self.paused or not self.settings.admit:
            return self._reject(n, 503, f"model '{self.name}' paused admission (memory emergency); retry later",
                                retry_after_s=retry_after)
        if self.waiting + n > spec.max_queued:
            return self._reject(
                n, 503, f"model '{self.name}' queue is full ({self.waiting} waiting, max_queued {spec.max_queued}); retry later",
                retry_after_s=retry_after,
            )
        # Reserve the queue slots before the first await: requests arriving together must not
        # all pass the max_queued check while each is still being validated.
        self.waiting += n
        try:
            items_or_error = await asyncio.to_thread(self._validate_all, inputs)
            if isinstance(items_or_error, dict):
                return items_or_error
            self.delta.arrivals += n
            tasks = [asyncio.ensure_future(self._admit_to_batcher(item)) for item in items_or_error]
            # asyncio.wait returns at the deadline even when an item sits in a running batch
            # (wait_for would wait for the cancelled batch to finish: a late 504).
            remaining = max(0.0, spec.request_timeout_s - (time.time() - t0))
            done, pending = await asyncio.wait(tasks, timeout=remaining)
            if pending:
                for t in pending:
                    t.cancel()
                self.delta.timeouts += n
                return _error(504, f"request waited over request_timeout_s ({spec.request_timeout_s:g}s) in model "
                                   f"'{self.name}'; retry later or raise the timeout")
            failed = next((t.exception() for t in tasks if t.exception() is not None), None)
            if failed is not None:
                self.delta.errors += n
                logger.error("gpubroker replica %s: batch failed: %r", self.name, failed)
                return _error(500, f"model '{self.name}' failed: {failed!r}")
            outputs = [t.result() for t in tasks]
        finally:
            self.waiting -= n
        ms = (time.time() - t0) * 1000.0
        self.delta.completions += n
        for _ in range(n):
            self.delta.add_latency(ms)
        return {"status": 200, "outputs": list(outputs), "model": self.name, "latency_ms": round(ms, 3)}

    # ------------------------------------------------------------------ introspection
    async def local_status(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "replica_id": self.replica_id,
            "settings": self.settings.to_dict(),
            "cap": self.cap,
            "paused": self.paused,
            "waiting": self.waiting,
            "registered": self.registered,
            "broker_failures": self.broker_failures,
            "last_broker_ok_s": self.last_broker_ok_s,
            "mem_used_bytes": self.mem_used_bytes,
            "device_free_frac": self.device_free_frac,
            "calibration": self.calibration,
            "batcher": {
                "max_batch_size": self._batch._get_max_batch_size(),
                "batch_wait_timeout_s": self._batch._get_batch_wait_timeout_s(),
            },
        }

    async def check_health(self) -> None:
        if self._report_task.done():  # restart the loop rather than fail the replica
            self._report_task = asyncio.get_running_loop().create_task(self._report_loop())
