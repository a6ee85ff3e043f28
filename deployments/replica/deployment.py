"""The batched model deployment: one Serve replica of one model (the Serve glue).

Per request (``infer``): admission (paused? queue over ``max_queued``? body over
``max_body_bytes``?) and input validation (``adapter.validate``) happen before anything
touches the model; each item then goes through Ray Serve's own ``@serve.batch`` (with a
``batch_size_fn`` that counts ``adapter.cost`` for token-priced models). A request still
queued after ``request_timeout_s`` gets an explicit timeout (its items leave the queue).

The parts with logic of their own are units with an injected clock, tested without Serve
and run unchanged by the simulator (``gpubroker.sim.engine``):

- ``gpubroker.deployments.replica.gate.LazyGate``: lazy batch formation in front of Serve's eager batcher;
- ``gpubroker.deployments.replica.fast_loop.fast_loop_step``: per batch, memory reading -> local cap, pause;
- ``gpubroker.deployments.replica.broker_link.BrokerLink``: stats deltas, one report per interval, retry.

A ``gpubroker.deployments.enforce.limits`` limiter holds this replica's share of the grant from before the
adapter loads; every grant change resets it (a shrink releases caches), every report reads it
back. The measurement layer (``gpubroker.deployments.enforce.watch``) ends a replica whose use stays over its
grant + slack past a grace, or whose limit was lifted: new requests get 503 meanwhile. The model runs through
``gpubroker.deployments.replica.oom.run_items``: an OOM, or any exception from ``predict``, splits the
batch; an item that fails even alone fails alone (507 out of memory; 422 an ``InputError``
naming the item and field; 500 another exception, its own only), the rest is answered; a batch too big for memory is reported (``oom_costs``) and
caps the local batch below it. Settings apply when their version changes; if the broker is
unreachable the replica keeps serving on its last settings and retries.

Results of ``infer`` are plain dicts with an HTTP-like ``status`` (200/413/422/503/504/507/500)
so the ingress maps them without depending on exception types crossing processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any

from gpubroker.broker.control.violation import (
    HELD_RESTART_T,
    WATCH_SLACK_BYTES,
    GrantHold,
    WatchLimits,
    lowered_grant_hold_s,
    watched_grant,
)
from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.models.base import OutputCountError
from gpubroker.deployments.replica.broker_link import BrokerLink, ReplicaGauges, StatsDelta
from gpubroker.deployments.replica.fast_loop import FastEvent, fast_loop_step, params_for
from gpubroker.deployments.replica.gate import LazyGate
from gpubroker.deployments.replica.inline_work import InlineOrThread
from gpubroker.deployments.replica.items import Item as _Item
from gpubroker.deployments.replica.items import batch_cost  # noqa: F401 - batch_cost is part of this module's API
from gpubroker.deployments.replica.items import error as _error
from gpubroker.deployments.replica.next_batch import NextBatchStart
from gpubroker.deployments.replica.oom import (
    HeldOverGrant,
    ItemError,
    ItemOOM,
    OomCeiling,
    item_error,
    need_from_calibration,
    oom_error,
)
from gpubroker.deployments.replica.reclaim import ReplicaReclaim
from gpubroker.deployments.replica.shed import HeldRequest, Late, LateShed, wait_items
from gpubroker.quotas.config import FleetConfig, ModelSpec

logger = logging.getLogger("ray.serve")

# HELD_RESTART_T (gpubroker.broker.control.violation): a replica held over its grant restarts itself after
# this many transfer_timeout_s (after the broker's escalation of a reclaim, 3 T, so a reclaim always
# restarts through its own step); the outside watchdog holds a lowered grant one T longer.


def initial_settings(name: str, spec: ModelSpec) -> ModelSettings:
    """What a replica runs before the broker has answered (version 0)."""
    return ModelSettings(
        model=name,
        version=0,
        max_batch_size=spec.batch.initial_cap,
        batch_wait_timeout_s=spec.wait.initial_s,
        grant_bytes=spec.quota.base,
        admit=True,
    )


def batch_failure_detail(model: str, exc: BaseException) -> str:
    """A 500's detail for a failure no single input explains (the batch's, or the replica's own):
    the model and the exception's type only, since its text may quote any request's input; a
    wrong output count (``OutputCountError``) holds counts only and is said in full."""
    if isinstance(exc, OutputCountError):
        return f"model '{model}' failed: {exc}; fix the model's predict"
    return f"model '{model}' failed running this request: {type(exc).__name__} (the replica's log has the error)"


class ModelReplica:
    """Serve deployment class; ``gpubroker.deployments.app`` binds one per model (named as the model)."""

    async def __init__(self, model_name: str, cfg: FleetConfig, card_id: str = "", card_replicas: int = 0):
        """``cfg``: the fleet config, parsed once by the app builder (``gpubroker.deployments.app``)
        and passed typed. ``card_id``/``card_replicas``: the card this replica's group was placed on
        and how many replicas of the model share the model's grant there
        (``gpubroker.deployments.serve.placement_resources``); empty/0 in a one-card fleet (all of
        the model's replicas share one grant)."""
        from ray import serve

        self._t0 = time.time()
        if model_name not in cfg.models:
            raise ValueError(f"model '{model_name}' is not in the config; known: {', '.join(cfg.models)}")
        self.name = model_name
        self.cfg = cfg
        self.spec: ModelSpec = cfg.models[model_name]
        self.card_id = card_id
        self.card_replicas = int(card_replicas) or self.spec.replicas
        self.in_serve = True  # a Serve replica owns its process: its memory limit is the model's
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            self.replica_id = f"{model_name}-{os.getpid()}"
            self.in_serve = False
        self.settings = initial_settings(model_name, self.spec)
        self.gate: LazyGate[tuple[asyncio.Future, _Item]] = LazyGate(
            max_concurrent_batches=self.spec.batch.max_concurrent_batches,
            cap=self.settings.max_batch_size,  # the local cap (``cap``): broker's, halved by the fast loop
            wait_s=self.settings.batch_wait_timeout_s,
        )
        self.paused = False  # fast-loop pause (memory critical)
        self.reclaim = ReplicaReclaim(model_name, lambda: self.limiter.release_caches(), logger.warning)
        self.waiting = 0  # requests admitted and not answered yet
        self.running_batches = 0  # batches in the model now (a lowered grant waits for them: _apply)
        self.enforce_pending = False  # a lowered grant to set once the running batches end
        self.held_since: float | None = None  # monotonic time the replica was first refused as held over its grant
        self.held_restart = ""  # why check_health fails: held over its grant past HELD_RESTART_T x T
        self.link = BrokerLink(
            model_name,
            self.replica_id,
            lambda: self._broker_handle(),
            rpc_timeout_s=max(2.0, 4.0 * cfg.broker.report_interval_s),
            card_id=card_id,
        )
        self.fast = params_for(self.spec, cfg)
        self.mem_used_bytes = 0
        self.device_free_frac: float | None = None
        self.sm_util_frac: float | None = None
        self.calibration: dict[str, Any] = {}
        self.token_priced = False
        self.oom_ceiling = OomCeiling(self.spec.batch.floor, self.spec.control.window_s)
        # Lazy formation (see _admit_to_batcher): requests wait at a gate while the executor is
        # busy and enter Serve's batcher together when it frees. On unless the model is pinned
        # static (a class with GATE_STATIC, bench.gated_static, keeps it), or the config says the
        # runtime's own formation is to be left alone.
        static = self.spec.control.strategy == "static" and not getattr(self, "GATE_STATIC", False)
        self.lazy_gate = not static and cfg.broker.batch_formation == "lazy"
        # shed_late: a request held at the gate that can no longer meet the SLO gets 504 (gpubroker.deployments.replica.shed)
        self.shed = LateShed(self.spec.slo_p95_ms / 1000.0) if self.spec.shed_late and self.lazy_gate else None
        self.next_start = NextBatchStart(self.lazy_gate and getattr(self, "START_NEXT_FIRST", True))
        # Batches never overlap in one adapter. Validation (in a thread, or inline once measured cheap:
        # gpubroker.deployments.replica.inline_work) is NOT under this lock: it would keep requests out for a whole
        # batch. Adapters make validate/cost safe beside predict (minilm locks its tokenizer only).
        self._model_lock, self.validating = threading.Lock(), InlineOrThread()
        await asyncio.to_thread(self._load)
        self._batch = serve.batch(
            max_batch_size=self.cap,
            batch_wait_timeout_s=self.settings.batch_wait_timeout_s,
            max_concurrent_batches=self.spec.batch.max_concurrent_batches + self.next_start.extra_slots,
            batch_size_fn=batch_cost if self.token_priced else None,
        )(self._run_batch)
        self._enforce(self.settings)
        await self._register()
        self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    # ------------------------------------------------------------------ start-up
    def _load(self) -> None:
        from gpubroker.broker.capacity import detect_capacity, detect_device
        from gpubroker.deployments.enforce.limits import make_limiter
        from gpubroker.deployments.enforce.probes import make_probe
        from gpubroker.deployments.enforce.watch import set_mps_memory_limit
        from gpubroker.deployments.models import load_adapter

        try:
            import torch  # noqa: F401 - the runtime is per-process overhead, not the model's
        except ImportError:
            pass
        set_mps_memory_limit(self.cfg.gpu.device, self.spec.quota.max // max(1, self.card_replicas))
        self.device = detect_device(self.cfg.gpu.device)
        capacity = self.cfg.gpu.capacity_bytes or detect_capacity(self.device)
        self.probe = make_probe(self.device, capacity)
        self.on_cuda = self.device.startswith("cuda")
        # On cpu, memory is host RSS: what this process held before the model counts like a
        # CUDA context (overhead), not against the model's quota.
        self.baseline_bytes = 0 if self.on_cuda else self.probe.read().process_bytes
        # The limit holds from before the model loads (its weights and calibration count); the
        # watchers (gpubroker.deployments.enforce.watch) from before the limit, which the watchdog must not inherit.
        self._start_watch()
        self.limiter = make_limiter(self.device, own_process=self.in_serve)
        self.limiter.start()
        self.limiter.set_grant(self._grant_per_replica(self.settings))
        self.adapter = load_adapter(self.spec.model, self.spec.options, self.device)
        self.token_priced = (
            getattr(self.adapter, "cost_unit", "requests") == "tokens" or self.spec.batch.unit == "tokens"
        )
        self.calibration = self._calibrate()
        self.calibration["enforcement"] = self.enforcement()  # gpubroker status shows it per model
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
            self.name,
            self.replica_id,
            self.device,
            time.time() - self._t0,
            self.calibration,
        )

    def _calibrate(self) -> dict[str, Any]:
        from gpubroker.deployments.replica.calibration import replica_calibration

        return replica_calibration(self.adapter, self.probe, self.device, self.token_priced, self.name)

    async def _register(self) -> None:
        reply = await self.link.register(self.calibration, self.settings.version)
        if reply is not None:
            self._apply(reply)

    # ------------------------------------------------------------------ broker link
    @property
    def cap(self) -> int:
        """The local batch cap: the broker's, halved by the fast loop (the gate lets in one cap)."""
        return self.gate.cap

    @cap.setter
    def cap(self, value: int) -> None:
        self.gate.cap = int(value)

    @property
    def delta(self) -> StatsDelta:
        return self.link.delta

    @property
    def registered(self) -> bool:
        return self.link.registered

    def _broker_handle(self):
        import ray

        return ray.get_actor(self.cfg.broker.name, namespace=self.cfg.broker.namespace)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.broker.report_interval_s)
            try:
                await self.report_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("gpubroker replica %s: report loop error", self.name)

    async def report_once(self) -> bool:
        """Send the delta since the last report; apply the settings in the reply."""
        if not self.link.registered:
            await self._register()
            if not self.link.registered:
                return False
        self._reassert()  # the in-process limit read back and set again; lifted: a violation
        self._read_memory()
        gauges = ReplicaGauges(
            self.waiting, self.mem_used_bytes, self.device_free_frac, self.sm_util_frac, self.settings.version
        )
        reply = await self.link.report(gauges)
        if reply is None:
            return False
        self._apply(reply)
        return True

    # ------------------------------------------------------------------ settings
    def _apply(self, new: ModelSettings) -> None:
        if new.version == self.settings.version and self.registered and new == self.settings:
            return
        old = self.settings
        self.settings = new
        self.cap = max(1, new.max_batch_size)
        self._batch.set_max_batch_size(self.cap)
        self._batch.set_batch_wait_timeout_s(max(0.0, new.batch_wait_timeout_s))
        self.gate.wait_s = max(0.0, new.batch_wait_timeout_s)
        if new.grant_bytes != old.grant_bytes or old.version == 0:
            if self.running_batches and new.grant_bytes < old.grant_bytes:
                # lowered under a running batch, the limit would cut it mid-way (and, on the host,
                # could leave the runtime beside it nothing): set it when the batch ends
                self.enforce_pending = True
            else:
                self.enforce_pending = False
                self._enforce(new)
        if new.admit:
            self.paused = False
        self.reclaim.on_settings(
            new
        )  # a reclaim's escalation (gpubroker.deployments.replica.reclaim): caches, drain, restart

    async def _run_batch(self, items: list[_Item]) -> list[Any]:
        from gpubroker.deployments.replica.oom import ItemPricing, run_items

        self._fast_loop()
        held = self._held_over_grant()
        values = [item.value for item in items]
        cost = sum(item.cost for item in items) if self.token_priced else len(items)

        def on_split(n: int) -> None:  # runs in the worker thread; counts into the current delta
            self.delta.oom_splits += 1

        start = time.perf_counter()
        self.next_start.batch_started(self.gate)
        for item in items:  # they run now: no longer pending in the batcher
            self._settle(item)
        costs = {id(v): float(item.cost) for v, item in zip(values, items)}
        self.running_batches += 1
        try:
            if held is not None:  # not run: every item is refused (503, retry later)
                return [held] * len(items)
            result = await asyncio.to_thread(
                run_items,
                self._predict,
                values,
                pricing=ItemPricing(
                    cost=lambda v: costs.get(id(v), 1.0),
                    need_bytes=need_from_calibration(self.calibration),
                    grant_bytes=self._grant_per_replica(self.settings),
                ),
                on_split=on_split,
                release=self.limiter.release_caches,
                held=self._held_after_oom,
            )
            if result.oom_costs:  # too big for memory as a batch: report it, cap the local batch below it
                self.delta.oom_costs.extend(result.oom_costs)
                self.cap = min(self.cap, self.oom_ceiling.learn(result.oom_costs))
                self._batch.set_max_batch_size(self.cap)
            if result.error_splits:  # predict raised: split until the failing items were found
                failed = ", ".join(f"item {e.index} {e.kind}" for e in result.errors)  # places in the batch
                logger.warning(
                    "gpubroker replica %s: batch of %d raised; %d splits found the items failing alone: %s",
                    self.name,
                    len(items),
                    result.error_splits,
                    failed or "none (the batch failed, its halves ran)",
                )
            return list(result.outputs)
        finally:
            exec_s = time.perf_counter() - start
            self.running_batches -= 1
            if self.enforce_pending and not self.running_batches:
                self.enforce_pending = False
                self._enforce(self.settings)
            self.gate.batch_ended()
            if self.shed is not None and held is None:
                self.shed.batch_ran(exec_s)
            await self.next_start.pump(self._pump, self.gate)  # what waited forms the next batch, started first
            if held is None:  # a refused batch did not run: no sample for the latency model
                d = self.delta  # the report may have swapped the delta while the batch ran
                d.batches.append((float(cost), exec_s * 1000.0))
                d.batch_requests.append(len(items))
                d.busy_s += exec_s

    @property
    def _released(self) -> int:
        return self.gate.released

    def _settle(self, item: _Item) -> None:
        """The item left the batcher's queue: it runs, or it was cancelled (Serve drops a
        cancelled request from its batch without a word, so the gate must count it out here)."""
        if item.let_in:
            item.let_in = False
            self.gate.settle(item.cost)

    def _pump(self) -> None:
        """The slot freed: the gate releases up to one cap's worth of held requests, which enter
        Serve's queue in this event-loop turn and form one batch."""
        for fut, item in self.gate.pump(alive=self._alive):
            item.let_in = True
            item.req.let_in(item.cost)
            fut.set_result(None)

    def _alive(self, token: tuple[asyncio.Future, _Item]) -> bool:
        """Still to be let in: not cancelled, and (shed_late) still able to meet the SLO."""
        fut, item = token
        if fut.done():
            return False
        late = None if self.shed is None else self.shed.check(self.name, item.req, time.monotonic(), self.cap)
        if late is not None:
            fut.set_result(late)
            return False
        return True

    async def _admit_to_batcher(self, item: _Item) -> Any:
        """Lazy batch formation on Ray 2.60's ``@serve.batch`` (``gpubroker.deployments.replica.gate``): a request
        waits at the gate while a batch runs and enters Serve's queue with the others when it
        ends. A request cancelled at the gate (request timeout) never reaches the model."""
        if not self.lazy_gate:
            return await self._batch(item)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            if self.gate.admit((fut, item), item.cost):
                item.let_in = True
                item.req.let_in(item.cost)
            elif isinstance(late := await fut, Late):
                return late  # shed at the gate: never reaches the model
            return await self._batch(item)
        except asyncio.CancelledError:
            if item.let_in:  # let in, then cancelled before its batch ran
                self._settle(item)
                self._pump()
            else:
                self.gate.drop((fut, item))
            raise

    # ------------------------------------------------------------------ requests
    def _validate_all(self, inputs: list) -> list[_Item] | dict[str, Any]:
        """Validated items with their cost, or a 422 naming every bad input: ``field`` and
        ``detail`` lead with the first, ``errors`` lists each (``field``, ``detail``) in order, so a
        client fixes its whole request at once (in a thread, or inline)."""
        from gpubroker.deployments.models import InputError

        items, errors = [], []
        for i, raw in enumerate(inputs):
            try:
                value = self.adapter.validate(raw)
                cost = int(self.adapter.cost(value)) if self.token_priced else 1
            except InputError as exc:
                where = f"inputs[{i}]" if exc.field == "body" else f"inputs[{i}].{exc.field}"
                errors.append({"field": where, "detail": f"{where}: {exc.message}"})
                continue
            except Exception as exc:  # noqa: BLE001 - a validator bug is still the input's 422, never a crash
                errors.append({"field": f"inputs[{i}]", "detail": f"inputs[{i}]: {exc}"})
                continue
            items.append(_Item(value, max(1, cost), self))
        if not errors:
            return items
        more = f" (and {len(errors) - 1} more bad input(s): see errors)" if len(errors) > 1 else ""
        return _error(422, errors[0]["detail"] + more, field=errors[0]["field"], errors=errors)

    def _predict(self, values: list) -> list:
        with self._model_lock:
            return self.adapter.predict(values)

    def _reject(self, n: int, status: int, detail: str, **extra: Any) -> dict[str, Any]:
        self.delta.rejections += n
        return _error(status, detail, **extra)

    async def infer(self, inputs: list, body_bytes: int = 0) -> dict[str, Any]:
        """Run ``inputs`` (a list of items); ``{"status": 200, "outputs": [...], "cost"}`` (the items'
        summed cost) or an error dict."""
        t0 = time.time()
        if not isinstance(inputs, list) or not inputs:
            return _error(422, "inputs must be a non-empty list of items", field="inputs")
        n = len(inputs)
        refused = self._admission_refusal(n, body_bytes)
        if refused is not None:
            return refused
        # Reserve the queue slots before the first await: requests arriving together must not
        # all pass the max_queued check while each is still being validated.
        self.waiting += n
        try:
            items_or_error = await self.validating.run(self._validate_all, inputs)  # thread or inline
            if isinstance(items_or_error, dict):
                return items_or_error
            self.delta.arrivals += n
            req = HeldRequest(time.monotonic() - (time.time() - t0), [i.cost for i in items_or_error])
            for item in items_or_error:
                item.req = req
            tasks = [asyncio.ensure_future(self._admit_to_batcher(item)) for item in items_or_error]
            outputs = await self._outcome(tasks, n, t0)
            if isinstance(outputs, dict):
                return outputs
        finally:
            self.waiting -= n
        ms = (time.time() - t0) * 1000.0
        self.delta.completions += n
        for _ in range(n):
            self.delta.add_latency(ms)
        cost = sum(item.cost for item in items_or_error)  # tokens for a token-priced model (embeddings' usage)
        return {"status": 200, "outputs": outputs, "model": self.name, "latency_ms": round(ms, 3), "cost": cost}

    def _retry_after_s(self) -> int:
        return max(1, int(round(self.cfg.broker.control_interval_s)))

    def _admission_refusal(self, n: int, body_bytes: int) -> dict[str, Any] | None:
        """Why a request of ``n`` inputs is refused before validation (413, 503), or None."""
        spec, retry_after = self.spec, self._retry_after_s()
        if body_bytes > spec.max_body_bytes:
            return self._reject(n, 413, f"body of {body_bytes} bytes is over max_body_bytes ({spec.max_body_bytes})")
        if violation := self.violation():  # over grant + slack past the grace (enforce.watch): drain
            self.delta.held_refusals += n
            return self._reject(n, 503, violation, retry_after_s=retry_after)
        if self.paused or not self.settings.admit or self.reclaim.actions.pause_admission:
            why = f"model '{self.name}' paused admission (memory emergency); retry later"
            return self._reject(n, 503, why, retry_after_s=retry_after)
        if self.waiting + n > spec.max_queued:
            why = (
                f"model '{self.name}' queue is full ({self.waiting} waiting, max_queued {spec.max_queued}); retry later"
            )
            return self._reject(n, 503, why, retry_after_s=retry_after)
        return None

    async def _outcome(self, tasks: list[asyncio.Future], n: int, t0: float) -> list[Any] | dict[str, Any]:
        """The request's outputs once its items ran, or its error: late (504), a failed batch (500),
        held over its grant (503), or one of its inputs failing alone (507, 422, 500)."""
        spec = self.spec
        # asyncio.wait returns at the deadline even when an item sits in a running batch
        # (wait_for would wait for the cancelled batch to finish: a late 504).
        remaining = max(0.0, spec.request_timeout_s - (time.time() - t0))
        done, pending, late = await wait_items(tasks, remaining, self.shed is not None)
        if late is not None:  # shed_late: it can no longer meet the SLO (gpubroker.deployments.replica.shed)
            for t in pending:
                t.cancel()  # its other items leave the gate, or their batch, before the model
            self.delta.timeouts += n
            self.delta.shed += n
            return _error(504, late.detail, shed=True)
        if pending:
            for t in pending:
                t.cancel()
            self.delta.timeouts += n
            return _error(
                504,
                f"request waited over request_timeout_s ({spec.request_timeout_s:g}s) in model "
                f"'{self.name}'; retry later or raise the timeout",
            )
        failed = next((t.exception() for t in tasks if t.exception() is not None), None)
        if failed is not None:  # the whole batch failed (no input at fault): its text may quote any of them
            self.delta.errors += n
            logger.error("gpubroker replica %s: batch failed: %r", self.name, failed)
            return _error(500, batch_failure_detail(self.name, failed))
        outputs = [t.result() for t in tasks]
        held = next((o for o in outputs if isinstance(o, HeldOverGrant)), None)
        if held is not None:  # its batch was refused before the model, or stopped after an OOM
            self.delta.held_refusals += n
            return self._reject(n, 503, held.detail(), retry_after_s=self._retry_after_s())
        lone = next(((i, o) for i, o in enumerate(outputs) if isinstance(o, (ItemOOM, ItemError))), None)
        if lone is not None:  # this input failed even alone (OOM, or predict raised); its batch ran
            self.delta.errors += n
            i, item = lone
            return oom_error(i, item) if isinstance(item, ItemOOM) else item_error(i, item, self.name)
        return outputs

    # ------------------------------------------------------------------ introspection
    async def local_status(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "replica_id": self.replica_id,
            "settings": self.settings.to_dict(),
            "cap": self.cap,
            "paused": self.paused,
            "waiting": self.waiting,
            "registered": self.link.registered,
            "broker_failures": self.link.failures,
            "last_broker_ok_s": self.link.last_ok_s,
            "mem_used_bytes": self.mem_used_bytes,
            "device_free_frac": self.device_free_frac,
            "calibration": self.calibration,
            "pid": os.getpid(),
            "memory_limit": asdict(self.limiter.read()),
            "enforcement": self.enforcement(),
            "cgroup": getattr(self.watchdog, "cgroup", ""),
            "watch_baseline_bytes": getattr(self, "watch_baseline_bytes", 0),
            "violation": self.violation(),
            "batcher": {
                "max_batch_size": self._batch._get_max_batch_size(),
                "batch_wait_timeout_s": self._batch._get_batch_wait_timeout_s(),
            },
        }

    async def check_health(self) -> None:
        self.reclaim.check_health()  # raises once the broker asked for a restart: Serve replaces us
        if self.held_restart:
            raise RuntimeError(self.held_restart)
        if violation := self.violation():
            raise RuntimeError(violation)
        if self._report_task.done():  # restart the loop rather than fail the replica
            self._report_task = asyncio.get_running_loop().create_task(self._report_loop())

    # ================================================================== memory: the grant as a limit
    # The grant as an OS or allocator limit (gpubroker.deployments.enforce.limits), re-asserted at every
    # report; the measurement layer that needs no cooperation (gpubroker.deployments.enforce.watch: the
    # watcher thread, the watchdog process and its cgroup, told every grant); the fast loop's reading of
    # memory; and a replica that holds over its grant (the limit keeps the runtime's slack; no batch runs;
    # after HELD_RESTART_T x transfer_timeout_s it restarts itself).

    def _grant_per_replica(self, settings: ModelSettings) -> int:
        return max(1, settings.grant_bytes // max(1, self.card_replicas))

    def _enforce(self, settings: ModelSettings) -> None:
        grant = self._grant_per_replica(settings)
        self._note_grant(grant)
        try:
            # CUDA: set_per_process_memory_fraction (+ empty_cache on a shrink); cpu: RLIMIT_DATA.
            reading = self.limiter.set_grant(grant)
            logger.info("gpubroker replica %s: memory limit for grant %d: %s", self.name, grant, reading)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: limiter.set_grant(%d) failed: %r", self.name, grant, exc)
        try:
            self.adapter.set_memory_limit(grant)
        except Exception as exc:  # noqa: BLE001
            logger.warning("gpubroker replica %s: set_memory_limit(%d) failed: %r", self.name, grant, exc)
        self._sync_watchdog()

    # ------------------------------------------------------------------ the measurement layer
    def _start_watch(self) -> None:
        """The layer the model cannot lift (``gpubroker.deployments.enforce.watch``): the registration with
        the node's watch agent (``gpubroker.deployments.enforce.agent``: a process outside every replica
        that takes this replica's grant from the broker, and its cgroup where the node allows), made
        before the model loads, and the watcher thread. Not for a replica outside Serve."""
        from gpubroker.deployments.enforce.watch import ReplicaWatch, WatchReadings, end_own_process

        self.watch = self.watchdog = None
        self.lifted = ""  # set when the in-process limit is found lifted (``_reassert``)
        self._grant_hold = GrantHold()
        self._watch_sent: WatchLimits | None = None
        if not self.in_serve:
            return
        overhead = self.cfg.gpu.context_overhead_bytes(1, True) if self.on_cuda else 0
        self.watch_baseline_bytes = overhead if self.on_cuda else self.baseline_bytes
        self._register_watchdog()
        readings = WatchReadings(self._watch_used, self._watch_limits, lifted=lambda: self.lifted)
        self.watch = ReplicaWatch(self.name, readings, on_end=end_own_process)
        self.watch.start()

    def _register_watchdog(self) -> None:
        from gpubroker.deployments.enforce.agent import AgentLink

        b = self.cfg.broker
        where = {"broker_name": b.name, "namespace": b.namespace, "hold_s": lowered_grant_hold_s(b.transfer_timeout_s)}
        try:
            link = AgentLink(
                self.name, self.card_id, self.card_replicas, self.device, self.watch_baseline_bytes, **where
            )
        except Exception as exc:  # noqa: BLE001 - no agent: the watcher thread holds, and says so
            logger.warning("gpubroker replica %s: no watch agent (%r): the watcher thread holds", self.name, exc)
            return
        if not link.accepted:
            logger.warning("gpubroker replica %s: watch agent refused it (%s)", self.name, link.why_not)
            return
        self.watchdog = link
        if not link.cgroup:
            logger.warning(
                "gpubroker replica %s: no kernel memory limit (%s): the measurement layer holds",
                self.name,
                link.why_not,
            )

    def _watch_used(self) -> int | None:
        """What the watchers measure: resident memory over the pre-model baseline on the host;
        NVML's bytes for this pid over the CUDA context on a card."""
        from gpubroker.deployments.enforce.watch import host_used_bytes

        if not self.on_cuda:
            return host_used_bytes(None, self.watch_baseline_bytes)
        return max(0, self.limiter.read().resident_bytes - self.watch_baseline_bytes)

    def _note_grant(self, grant: int) -> None:
        """A lowered grant binds the watchers only after the broker's reclaim escalation had its
        time (``lowered_grant_hold_s``): until then they hold the old one."""
        hold_s = lowered_grant_hold_s(self.cfg.broker.transfer_timeout_s)
        _, self._grant_hold = watched_grant(self._grant_hold, grant, time.monotonic(), hold_s)

    def _watch_limits(self) -> WatchLimits:
        grant = self._grant_per_replica(self.settings)
        hold_s = lowered_grant_hold_s(self.cfg.broker.transfer_timeout_s)
        watched, _ = watched_grant(getattr(self, "_grant_hold", GrantHold()), grant, time.monotonic(), hold_s)
        return WatchLimits(watched, WATCH_SLACK_BYTES)

    def _sync_watchdog(self) -> None:
        """The limits changed here: nudge the agent to pull the broker's grant now (it takes no number)."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is None:
            return
        limits = self._watch_limits()
        if limits != self._watch_sent:
            watchdog.nudge()
            self._watch_sent = limits

    def _reassert(self) -> None:
        """At every report: the in-process limit read back and set again; found lifted, the
        watcher declares a violation at its next reading."""
        try:
            lifted = self.limiter.reassert()
        except Exception as exc:  # noqa: BLE001 - a reading, never a failure
            logger.warning("gpubroker replica %s: limit re-assert failed: %r", self.name, exc)
            return
        if lifted and not self.lifted:
            self.lifted = lifted
            logger.warning("gpubroker replica %s: %s", self.name, lifted)
        self._sync_watchdog()

    def enforcement(self) -> str:
        """Which layers hold this replica: ``cgroup`` (a kernel limit, plus the others),
        ``rlimit+watch``, ``fraction+watch``, ``watch``; ``unenforced`` outside Serve."""
        if getattr(self, "watch", None) is None:
            return "unenforced"
        if self.watchdog is not None and self.watchdog.cgroup:
            return "cgroup"
        kind = str(getattr(self.limiter, "kind", ""))
        return {"rlimit_data": "rlimit+watch", "cuda_fraction": "fraction+watch"}.get(kind, "watch")

    def violation(self) -> str:
        """The watcher's declared violation ("" when none): new work is refused with it."""
        watch = getattr(self, "watch", None)
        return "" if watch is None else watch.violation

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
        self.limiter.refresh()
        target = self.oom_ceiling.target(self.settings.max_batch_size)
        # on a card the reading is the card's: a replica within its grant is not the one to stop
        within = self.on_cuda and self.mem_used_bytes <= self._grant_per_replica(self.settings)
        out = fast_loop_step(free, self.cap, target, self.paused, self.fast, within_grant=within)
        if out.cap != self.cap:
            self.cap = out.cap
            self._batch.set_max_batch_size(out.cap)
        self.paused = out.paused
        if out.counted:
            self.delta.emergency_shrinks += 1
        if out.event in (FastEvent.SHRINK, FastEvent.PAUSE) and out.counted:
            logger.warning(
                "gpubroker replica %s: free %.1f%% < %.1f%%: %s, batch cap %d",
                self.name,
                100 * (free or 0.0),
                100 * self.fast.emergency_free_frac,
                out.event,
                out.cap,
            )

    def _held_over_grant(self) -> HeldOverGrant | None:
        """The process holds more than its grant, by the limiter's count (host: VmData, the
        limit's own) and by the broker's (resident memory over the baseline): the batch is refused
        before the model, whose next allocation would take the runtime's slack.

        A reclaim or release under it escalates in the broker (caches, drain, restart: 3 T). A
        replica held over with no such transfer (a model that keeps what it allocates, at its own
        grant) restarts itself once its batches have been refused for ``HELD_RESTART_T`` x T (it
        is checked as batches come): its check_health fails from then on (sticky, as the broker's
        restart), Serve replaces it, the new process holds nothing."""
        over = getattr(self.limiter, "held_over", None)
        grant = self._grant_per_replica(self.settings)
        if not over or self.mem_used_bytes <= grant:
            self.held_since = None
            return None
        now = time.monotonic()
        if self.held_since is None:
            self.held_since = now
        bound_s = HELD_RESTART_T * self.cfg.broker.transfer_timeout_s
        if not self.held_restart and now - self.held_since >= bound_s:
            self.held_restart = (
                f"model '{self.name}' holds {self.mem_used_bytes / 2**20:.1f} MiB, over its grant of "
                f"{grant / 2**20:.1f} MiB, for {bound_s:g}s: fail check_health so Serve restarts the replica"
            )
            logger.warning("gpubroker replica %s: %s", self.name, self.held_restart)
        return HeldOverGrant(self.name, int(self.mem_used_bytes), grant)

    def _held_after_oom(self) -> HeldOverGrant | None:
        """In the batch's thread, after an out-of-memory error: measure again (the limit's floor
        rises over what is held, so the runtime can allocate) and say whether the model must stop."""
        try:
            self.limiter.refresh(after_oom=True)
            self._read_memory()
            return self._held_over_grant()
        except MemoryError:  # not even room to measure: stop the model, the next batch measures again
            grant = self._grant_per_replica(self.settings)
            return HeldOverGrant(self.name, max(int(self.mem_used_bytes), grant + 1), grant)
