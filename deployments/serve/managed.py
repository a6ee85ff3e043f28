"""Bring your own Serve deployment under the broker: ``gpubroker.managed``.

A Ray Serve user with an existing app (``@serve.deployment`` classes with their own routes,
``@serve.batch`` methods, ``DeploymentHandle`` composition, ``reconfigure(user_config)``) adds one
line under ``@serve.deployment``::

    @serve.deployment
    @gpubroker.managed("scorer", config="fleet.yaml")
    class Scorer:
        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
        async def score(self, xs: list[float]) -> list[float]: ...

``managed`` returns a subclass (the user's class is left as it is, so one class may be managed
under two names) whose replicas take part in the broker's loop as a gpubroker replica does:

- the replica registers with the broker actor and sends it one ``StatsReport`` per
  ``broker.report_interval_s`` over the same ``BrokerLink`` a gpubroker replica uses (arrivals,
  completions and latency of the calls into its ``@serve.batch`` methods, each batch's size and
  time, the calls waiting there, the process's memory), and gets its settings back in the reply;
- every ``@serve.batch`` method takes the broker's ``max_batch_size`` and
  ``batch_wait_timeout_s`` (Ray's own setters on the batcher), and the in-process memory limit
  (``gpubroker.deployments.enforce.limits``: RLIMIT_DATA on cpu, torch's per-process fraction on CUDA)
  follows the replica's share of the model's grant.

The fleet config (``config``: the same YAML as ``gpubroker up`` reads) names the model with its
quota, batch bounds, wait range, SLO and, under ``profile``, the memory model the broker sizes the
batch by (``weights_bytes``, ``bytes_per_item``). It is read when the class is decorated (a
missing model is an error there, at ``serve run`` / ``serve deploy`` build time) and travels with
the class. The first replica to start creates the broker actor from it (detached, named
``broker.name`` in ``broker.namespace``); later ones, and those of other managed deployments, find
the running one. Without ``config`` the replica finds a running broker by ``broker``/``namespace``
and reads its model there.

Not covered (a gpubroker replica's own machinery, which needs to own the request path): the
measurement layer (watcher, watchdog, cgroup), the fast loop's emergency halving, split-and-retry
on an OOM, admission pauses and ``max_queued``, lazy batch formation and shedding, a reclaim's
drain and restart steps, and token-priced batches (a batch counts requests).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpubroker.broker.wire import Calibration, ModelSettings
from gpubroker.deployments.replica.broker_link import BrokerLink, ReplicaGauges
from gpubroker.quotas.config import FleetConfig, ModelSpec, parse_config_text

logger = logging.getLogger("ray.serve")

STATE_ATTR = "_gpubroker_managed"  # the replica's ManagedReplica, on the user's instance


# ---------------------------------------------------------------------------------------------
# The class: its @serve.batch methods, found and wrapped once, at decoration time.


def is_batch_method(attr: Any) -> bool:
    """A function ``@serve.batch`` made: Ray's batcher gives it ``set_max_batch_size`` and
    ``set_batch_wait_timeout_s`` (ray/serve/batching.py)."""
    return callable(attr) and hasattr(attr, "set_max_batch_size") and hasattr(attr, "set_batch_wait_timeout_s")


def batch_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The class's ``@serve.batch`` methods (inherited ones included), by name."""
    return {
        name: attr for name in dir(cls) if not name.startswith("__") and is_batch_method(attr := getattr(cls, name))
    }


def model_spec(cfg: FleetConfig, model: str, source: str) -> ModelSpec:
    """The fleet config's ``model`` (``source``: where the config came from, for the error); a
    model it lacks is an error naming the ones it has."""
    if model not in cfg.models:
        raise ValueError(
            f"gpubroker.managed('{model}'): {source} has no model '{model}' (models: {', '.join(cfg.models)}); "
            f"add models.{model} with its quota, or pass the name the config uses"
        )
    spec = cfg.models[model]
    if spec.kind != "batch":
        raise ValueError(
            f"gpubroker.managed('{model}'): models.{model} is kind: {spec.kind}; a Serve deployment under "
            "the broker is a batch model: write kind: batch"
        )
    return spec


def calibration_of(spec: ModelSpec, measured_weights_bytes: int) -> Calibration:
    """What the replica registers with: the memory model the broker sizes the batch by. The
    config's ``profile`` figures when given; else the weights are what ``__init__`` was measured
    to take and there is no per-item figure (memory then does not cap the batch)."""
    profile = spec.profile
    weights = profile.weights_bytes if profile is not None and profile.weights_bytes is not None else None
    cal: Calibration = {"weights_bytes": int(weights if weights is not None else measured_weights_bytes)}
    if profile is not None and profile.bytes_per_item is not None:
        cal["bytes_per_item"] = float(profile.bytes_per_item)
    cal["cost_unit"] = "requests"
    return cal


def _batch_len(args: tuple, kwargs: dict) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    return len(first) if isinstance(first, list) else 1


def _timed(func: Callable[..., Any]) -> Callable[..., Any]:
    """The batch function, timed: each batch's size and execution time go to the replica's report."""

    @functools.wraps(func)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = getattr(self, STATE_ATTR, None)
        start = time.perf_counter()
        try:
            out = func(self, *args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        finally:
            if state is not None:
                state.batch_ran(_batch_len(args, kwargs), time.perf_counter() - start)

    return run


def _counted(batched: Callable[..., Any], batch_fn: Callable[..., Any]) -> Callable[..., Any]:
    """One call into the batcher, counted (arrival, queue depth, completion and latency)."""

    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = getattr(self, STATE_ATTR, None)
        if state is None:  # called before the replica started (from __init__): not counted
            return await batched(self, *args, **kwargs)
        start = state.arrived()
        ok = False
        try:
            out = await batched(self, *args, **kwargs)
            ok = True
            return out
        finally:
            state.finished(start, ok)

    functools.update_wrapper(call, batched)  # name, doc, and the batcher's setters
    # Ray's batcher finds ``self`` by checking that the method's ``__wrapped__`` is its batch function
    # (ray.serve._private.utils.extract_self_if_method_call).
    call.__wrapped__ = batch_fn  # type: ignore[attr-defined]
    return call


def rebatch(method: Callable[..., Any]) -> Callable[..., Any]:
    """A ``@serve.batch`` method again, with the same settings, whose batches and calls are counted.
    A streaming (async generator) batch method is kept as is: its cap and wait are set, its calls
    not counted."""
    from ray import serve

    func = getattr(method, "__wrapped__", None)
    if func is None or inspect.isasyncgenfunction(func):
        return method
    # The batcher keeps max_concurrent_batches and batch_size_fn on its lazy queue wrapper, whose
    # getter is bound to it (ray/serve/batching.py, _LazyBatchQueueWrapper).
    queue = getattr(method._get_max_batch_size, "__self__", None)  # type: ignore[attr-defined]
    batch_fn = _timed(func)
    batched = serve.batch(
        max_batch_size=method._get_max_batch_size(),  # type: ignore[attr-defined]
        batch_wait_timeout_s=method._get_batch_wait_timeout_s(),  # type: ignore[attr-defined]
        max_concurrent_batches=getattr(queue, "max_concurrent_batches", 1),
        batch_size_fn=getattr(queue, "batch_size_fn", None),
    )(batch_fn)
    return _counted(batched, batch_fn)


# ---------------------------------------------------------------------------------------------
# The replica: one per Serve replica process.


@dataclass(frozen=True)
class Applied:
    """What one settings reply changed on the replica."""

    max_batch_size: int
    batch_wait_timeout_s: float
    grant_per_replica_bytes: int | None  # None: the grant did not change


class ManagedReplica:
    """The broker's side of one managed replica: counts into the link's delta, reports, applies."""

    def __init__(
        self,
        spec: ModelSpec,
        link: BrokerLink,
        methods: dict[str, Callable[..., Any]],
        *,
        limiter: Any,
        read_memory: Callable[[], int],
        settings: ModelSettings,
    ) -> None:
        self.spec = spec
        self.link = link
        self.methods = methods  # the class's @serve.batch methods: the broker's cap and wait go there
        self.limiter = limiter  # gpubroker.deployments.enforce: the in-process limit
        self.read_memory = read_memory  # this replica's memory in use now, bytes
        self.settings = settings
        self.waiting = 0
        self.mem_used_bytes = 0
        self._report_task: asyncio.Task | None = None

    # ------------------------------------------------------------ counting (the wrappers call these)
    def arrived(self) -> float:
        self.link.delta.arrivals += 1
        self.waiting += 1
        return time.perf_counter()

    def finished(self, start: float, ok: bool) -> None:
        self.waiting -= 1
        if ok:
            self.link.delta.completions += 1
            self.link.delta.add_latency((time.perf_counter() - start) * 1000.0)
        else:
            self.link.delta.errors += 1

    def batch_ran(self, n: int, exec_s: float) -> None:
        d = self.link.delta  # the report may have swapped the delta while the batch ran
        d.batches.append((float(n), exec_s * 1000.0))
        d.batch_requests.append(n)
        d.busy_s += exec_s

    # ------------------------------------------------------------ settings
    def grant_per_replica(self, settings: ModelSettings) -> int:
        return max(1, settings.grant_bytes // max(1, self.spec.replicas))

    def apply(self, new: ModelSettings, *, first: bool = False) -> Applied:
        """The broker's cap and wait on every ``@serve.batch`` method; a changed grant to the limit."""
        old, self.settings = self.settings, new
        cap, wait = max(1, int(new.max_batch_size)), max(0.0, float(new.batch_wait_timeout_s))
        for method in self.methods.values():
            method.set_max_batch_size(cap)  # type: ignore[attr-defined]
            method.set_batch_wait_timeout_s(wait)  # type: ignore[attr-defined]
        grant = None
        if first or new.grant_bytes != old.grant_bytes:
            grant = self.grant_per_replica(new)
            try:
                self.limiter.set_grant(grant)
            except Exception as exc:  # noqa: BLE001 - the batch cap still follows the grant
                logger.warning("gpubroker managed %s: memory limit %d not set: %r", new.model, grant, exc)
        if new.release_cache:
            self.limiter.release_caches()
        return Applied(cap, wait, grant)

    # ------------------------------------------------------------ the report loop
    async def register(self, calibration: Calibration) -> bool:
        reply = await self.link.register(calibration, self.settings.version)
        if reply is not None:
            self.apply(reply, first=True)
        return reply is not None

    async def report_once(self, calibration: Calibration) -> bool:
        """Send the delta since the last report; apply the settings in the reply. False: no reply."""
        if not self.link.registered and not await self.register(calibration):
            return False
        if lifted := self.limiter.reassert():
            logger.warning("gpubroker managed %s: memory limit found changed: %s", self.settings.model, lifted)
        self.mem_used_bytes = self.read_memory()
        self.link.delta.mem_peak_bytes = max(self.link.delta.mem_peak_bytes, self.mem_used_bytes)
        gauges = ReplicaGauges(self.waiting, self.mem_used_bytes, None, None, self.settings.version)
        reply = await self.link.report(gauges)
        if reply is None:
            return False
        self.apply(reply)
        return True

    async def run(self, calibration: Calibration, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.report_once(calibration)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                logger.exception("gpubroker managed %s: report loop error", self.settings.model)

    def start_reporting(self, calibration: Calibration, interval_s: float) -> None:
        self._report_task = asyncio.get_running_loop().create_task(self.run(calibration, interval_s))

    def status(self) -> dict[str, Any]:
        """What the replica runs now: the broker's settings and each batch method's live values."""
        return {
            "settings": self.settings.to_dict(),
            "registered": self.link.registered,
            "waiting": self.waiting,
            "mem_used_bytes": self.mem_used_bytes,
            "memory_limit": getattr(self.limiter.read(), "limit_bytes", None),
            "batch_methods": {
                name: {
                    "max_batch_size": m._get_max_batch_size(),  # type: ignore[attr-defined]
                    "batch_wait_timeout_s": m._get_batch_wait_timeout_s(),  # type: ignore[attr-defined]
                }
                for name, m in self.methods.items()
            },
        }


# ---------------------------------------------------------------------------------------------
# Start-up inside a Serve replica.


@dataclass(frozen=True)
class ManagedOptions:
    """What the decorator fixed: the model's name and the fleet config, typed (``cfg``) and as its
    text (``config_text``, what a replica starts the broker with), or where the broker is."""

    model: str
    config_text: str | None
    cfg: FleetConfig | None
    broker_name: str
    namespace: str


def _broker_and_config(opts: ManagedOptions) -> tuple[Any, str]:
    """The broker actor and its config text: started from ``config_text`` when none runs."""
    from gpubroker.broker.actor import get_broker, start_broker

    if opts.config_text is not None and opts.cfg is not None:
        try:
            handle = get_broker(opts.cfg.broker.name, opts.cfg.broker.namespace)
        except ValueError:
            handle = start_broker(opts.config_text)  # get_if_exists: a replica starting beside us may win
    else:
        try:
            handle = get_broker(opts.broker_name, opts.namespace)
        except ValueError:
            raise RuntimeError(
                f"gpubroker.managed('{opts.model}'): no broker '{opts.broker_name}' in namespace "
                f"'{opts.namespace}'; pass config='fleet.yaml' so the replica starts one, or start it first"
            ) from None
    import ray

    return handle, str(ray.get(handle.config_text.remote(), timeout=60))


def _replica_id(model: str) -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (tests)
        return f"{model}-{os.getpid()}"


class _Memory:
    """This process's memory in use, over what it held before the user's ``__init__`` on cpu."""

    def __init__(self, cfg: FleetConfig) -> None:
        from gpubroker.broker.capacity import detect_capacity, detect_device
        from gpubroker.deployments.enforce.probes import make_probe

        self.device = detect_device(cfg.gpu.device)
        self.on_cuda = self.device.startswith("cuda")
        self.probe = make_probe(self.device, cfg.gpu.capacity_bytes or detect_capacity(self.device))
        self.baseline = 0 if self.on_cuda else int(self.probe.read().process_bytes)

    def used(self) -> int:
        try:
            return max(0, int(self.probe.read().process_bytes) - self.baseline)
        except Exception:  # noqa: BLE001 - no reading: report none
            return 0


async def start_replica(instance: Any, opts: ManagedOptions, methods: dict[str, Callable[..., Any]], init: Any) -> None:
    """Start one managed replica around the user's ``__init__`` (``init``: a coroutine function
    taking no arguments): the broker found or started, the memory limit set to the base share
    before the user's code loads, then registration and the report loop."""
    from gpubroker.deployments.enforce.limits import make_limiter
    from gpubroker.deployments.replica.deployment import initial_settings

    handle, config_text = await asyncio.to_thread(_broker_and_config, opts)
    # The broker's config arrives as text from its actor (it may have been applied since the
    # decorator read the file): an input, parsed here once for this replica.
    source = f"the broker's config for '{opts.model}'"
    cfg = parse_config_text(config_text, source)
    spec = model_spec(cfg, opts.model, source)
    memory = await asyncio.to_thread(_Memory, cfg)
    limiter = make_limiter(memory.device, own_process=True)
    limiter.start()
    replica_id = _replica_id(opts.model)
    link = BrokerLink(
        opts.model, replica_id, lambda: handle, rpc_timeout_s=max(2.0, 4.0 * cfg.broker.report_interval_s)
    )
    state = ManagedReplica(
        spec, link, methods, limiter=limiter, read_memory=memory.used, settings=initial_settings(opts.model, spec)
    )
    state.apply(state.settings, first=True)
    await init()
    setattr(instance, STATE_ATTR, state)
    calibration = calibration_of(spec, memory.used())
    calibration["enforcement"] = str(getattr(limiter, "kind", "unenforced"))
    await state.register(calibration)
    state.start_reporting(calibration, cfg.broker.report_interval_s)
    logger.info("gpubroker managed %s/%s: registered=%s %s", opts.model, replica_id, link.registered, calibration)


# ---------------------------------------------------------------------------------------------
# The decorator.


def _read_config(config: str | Path | None) -> str | None:
    if config is None:
        return None
    path = Path(config).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"gpubroker.managed: cannot read config {path}: {exc}; pass the fleet YAML's path") from None


def managed(
    model: str,
    *,
    config: str | Path | None = None,
    config_text: str | None = None,
    broker: str = "gpubroker",
    namespace: str = "gpubroker",
) -> Callable[[type], type]:
    """Put a Serve deployment class under the broker as model ``model`` (apply it under
    ``@serve.deployment``). ``config``: the fleet YAML naming the model (or ``config_text``, its
    text), read now; its replicas start the broker from it when none runs. Neither: the replica
    finds a running broker named ``broker`` in ``namespace`` and reads the model there."""
    if config is not None and config_text is not None:
        raise ValueError("gpubroker.managed: pass config (a path) or config_text, not both")
    text = config_text if config_text is not None else _read_config(config)
    cfg = None
    if text is not None:  # the user's file (or text): parsed once here, the typed config travels with the class
        cfg = parse_config_text(text, str(config or "config_text"))
        model_spec(cfg, model, str(config or "config_text"))  # refuse a config without the model now
    opts = ManagedOptions(model, text, cfg, broker, namespace)

    def wrap(cls: type) -> type:
        if not isinstance(cls, type):
            raise TypeError(
                f"gpubroker.managed('{model}') takes a class; put it under @serve.deployment "
                "(@serve.deployment on top, @gpubroker.managed(...) right above the class)"
            )
        found = batch_methods(cls)
        if not found:
            logger.warning("gpubroker.managed('%s'): %s has no @serve.batch method to size", model, cls.__name__)
        wrapped = {name: rebatch(method) for name, method in found.items()}
        user_init = cls.__init__  # type: ignore[misc]  # the class's own, called on its instance

        async def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            async def init() -> None:
                out = user_init(self, *args, **kwargs)
                if inspect.isawaitable(out):
                    await out

            await start_replica(self, opts, {n: getattr(type(self), n) for n in wrapped}, init)

        functools.update_wrapper(__init__, user_init)
        namespace_ = {**wrapped, "__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        namespace_["__doc__"] = cls.__doc__
        namespace_["gpubroker_status"] = _status_method
        sub = type(cls.__name__, (cls,), namespace_)
        sub.gpubroker_model = model  # type: ignore[attr-defined]
        return sub

    return wrap


async def _status_method(self: Any) -> dict[str, Any]:
    """The managed replica's settings and live batcher values (call it through a handle)."""
    state = getattr(self, STATE_ATTR, None)
    return {"managed": False} if state is None else {"managed": True, **state.status()}
