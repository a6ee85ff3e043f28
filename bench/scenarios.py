"""Live-stack benchmark plumbing: one Ray instance, one Serve app per arm, the open-loop
load generator against it, and a knee search over measured rates.

- ``Stack`` starts Ray (``address="local"``: never joins another engineer's cluster) and
  Serve's HTTP proxy on a free port, once per scenario; ``Stack.deploy_fleet`` runs
  ``gpubroker.deployments.app.build_app`` as one Serve app (its own broker actor, named per arm so no
  state leaks between arms) and ``Stack.delete`` removes the app and kills its broker.
- A fleet arm pinned to a static setting is the same app with ``control.strategy: static``
  (``batch.initial`` / ``wait.initial_ms``); ``FleetTarget.set_static`` moves the pin live
  through the broker's ``apply`` (no redeploy), which is how the oracle grid stays cheap.
- ``measure`` runs one schedule and returns the per-model summary, batch statistics from
  the responses' batch tags (``bench.tagged``), and the status polls.
- ``live_knee`` finds λ_max of one target: step the rate up ×``step`` from a passing rate
  until one fails (or down until one passes), then bisect ``bisect_iters`` times.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from bench import loadgen as lg
from bench.fleet_specs import (  # noqa: F401 - re-exported
    fleet_yaml,
    minilm_spec,
    pin_static,
    profiled_spec,
)
from bench.live_util import (  # noqa: F401 - re-exported  # noqa: F401 - re-exported
    eager_batch,
    eager_saturation,
    free_port,
    http_json,
    machine_info,
    poisson_schedule,
    spread,
    wait_http,
)
from bench.tagged import TAGGED  # noqa: F401 - re-exported

MiB = 1024**2

# ------------------------------------------------------------------------------ the stack


class Stack:
    """Ray + Serve for one scenario; apps come and go per arm."""

    def __init__(self, port: int | None = None, num_cpus: int | None = None, direct_ingress: bool = False):
        """``direct_ingress``: Ray started with Serve's direct ingress (``gpubroker.deployments.serve.direct_ingress``):
        every ingress replica also answers on its own port, and ``FleetTarget.infer_base`` sends a one-model fleet's load there."""
        self.direct_ingress = direct_ingress
        self._env_set: list[str] = []
        self.port = port or free_port()
        self.num_cpus = num_cpus or max(4, os.cpu_count() or 2)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._apps: dict[str, str | None] = {}  # app name -> broker name
        self._models: dict[str, list[str]] = {}  # fleet app name -> its model apps

    def __enter__(self) -> Stack:
        import ray
        from ray import serve

        from gpubroker.deployments.serve.http_proxy import PROXY_ENV

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        for key, value in PROXY_ENV.items():  # the proxy's own refusals as JSON (lost replica, Serve queue)
            os.environ.setdefault(key, value)
        if self.direct_ingress:  # Ray's processes inherit it; taken out again on exit
            from gpubroker.deployments.serve.direct_ingress import DIRECT_ENV

            for key, value in DIRECT_ENV.items():
                if key not in os.environ:
                    os.environ[key] = value
                    self._env_set.append(key)
        ray.init(
            address="local",
            num_cpus=self.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            namespace="gpubroker-bench",
        )
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray
        from ray import serve

        for app in list(self._apps):
            try:
                self.delete(app)
            except Exception:  # noqa: BLE001
                pass
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for key in self._env_set:
                os.environ.pop(key, None)
            self._env_set = []

    def deploy_fleet(
        self,
        config_text: str,
        app: str = "fleet",
        *,
        warm_models: Mapping[str, bytes] | None = None,
        timeout_s: float = 180.0,
        route_prefix: str = "/",
        model_cls: type | None = None,
    ) -> FleetTarget:
        from gpubroker.broker.actor import start_broker
        from gpubroker.deployments.app import AppLayout, fleet_apps, run_fleet
        from gpubroker.deployments.serve.http_model import HttpModel
        from gpubroker.quotas.config import parse_config_text

        cfg = parse_config_text(config_text, "bench fleet")
        start_broker(config_text)
        layout = AppLayout(fleet_app=app, prefix=route_prefix, model_cls=model_cls or HttpModel)
        apps = fleet_apps(cfg, config_text, layout)  # one app per model: one hop
        run_fleet(apps, wait=True)
        self._models[app] = [a.name for a in apps[1:]]
        base = self.base_url + route_prefix.rstrip("/")
        self._apps[app] = cfg.broker.name
        names = list(cfg.models)

        def registered(_c: int, doc: Any) -> bool:
            return all((doc.get("models", {}).get(n, {}).get("replicas") or 0) >= 1 for n in names)

        wait_http(base + "/v1/status", timeout_s=timeout_s, ok=registered)
        for n in names:
            body = json.loads((warm_models or {}).get(n, b'{"inputs": [{}]}'))
            for _ in range(3):
                wait_http(f"{base}/v1/models/{n}/infer", body, timeout_s=timeout_s)
        direct: dict[str, str] = {}
        if self.direct_ingress:  # each model's first replica port and the fleet's prefix: its loads' base
            from gpubroker.deployments.app import model_app_name

            for n in names:
                direct[n] = self._direct_base(model_app_name(n, app), timeout_s)[: -len(f"/v1/models/{n}")]
        return FleetTarget(
            self,
            app,
            config_text,
            cfg.broker.name,
            cfg.broker.namespace,
            base_url=base,
            direct_bases=direct,
        )

    def deploy_plain(
        self,
        model_ref: str,
        options: Mapping[str, Any],
        batch: int,
        wait_ms: float,
        name: str,
        app: str = "plain",
        *,
        warm_body: bytes = b'{"inputs": [{}]}',
        timeout_s: float = 180.0,
        route_prefix: str = "/",
    ) -> PlainTarget:
        from ray import serve

        from bench.plain_serve import build_plain

        serve.run(
            build_plain(model_ref, dict(options), batch, wait_ms, name),
            name=app,
            route_prefix=route_prefix,
            blocking=False,
        )
        self._apps[app] = None
        base = self.base_url + route_prefix.rstrip("/")
        for _ in range(3):
            wait_http(f"{base}/v1/models/{name}/infer", json.loads(warm_body), timeout_s=timeout_s)
        return PlainTarget(self, app, name, base_url=base, load_base=self._direct_base(app, timeout_s))

    def _direct_base(self, app: str, timeout_s: float) -> str:
        """Under direct ingress, the base URL of ``app``'s first ingress replica (its own port and
        route prefix); else ""."""
        if not self.direct_ingress:
            return ""
        from gpubroker.deployments.serve.direct_ingress import wait_replica_ports

        ports = wait_replica_ports({app: app}, "127.0.0.1", timeout_s)[app]
        if not ports:
            raise RuntimeError(f"app {app}: no direct-ingress port after {timeout_s:.0f} s")
        base, prefix = ports[0]
        return base + prefix

    def delete(self, app: str) -> None:
        import ray
        from ray import serve

        broker = self._apps.pop(app, None)
        for model_app in self._models.pop(app, []):
            serve.delete(model_app, _blocking=True)
        serve.delete(app, _blocking=True)
        if broker:
            try:
                ray.kill(ray.get_actor(broker, namespace="gpubroker-bench"), no_restart=True)
            except ValueError:
                pass


@dataclass
class FleetTarget:
    stack: Stack
    app: str
    config_text: str
    broker_name: str
    namespace: str
    base_url: str = ""
    kind: str = "fleet"
    direct_bases: dict[str, str] = field(default_factory=dict)  # model -> its replica's own port (direct ingress)

    @property
    def infer_base(self) -> str:
        """Where loads go: a one-model fleet under direct ingress, its replica's port; else the proxy."""
        return next(iter(self.direct_bases.values())) if len(self.direct_bases) == 1 else self.base_url

    @property
    def status_url(self) -> str:
        return self.base_url + "/v1/status"

    def idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no model has a queue (the previous run's backlog is gone)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            code, doc = http_json(self.status_url)
            if code == 200 and all((m.get("queue_depth") or 0) == 0 for m in doc.get("models", {}).values()):
                return
            time.sleep(0.5)

    def set_static(self, batch_by_model: Mapping[str, tuple[int, float]]) -> None:
        """Move the static pin of each model live (broker ``apply``; the app keeps running)."""
        doc = yaml.safe_load(self.config_text)
        for name, (b, w) in batch_by_model.items():
            doc["models"][name] = pin_static(doc["models"][name], b, w)
        self.apply(yaml.safe_dump(doc, sort_keys=False))

    def broker(self):
        import ray

        return ray.get_actor(self.broker_name, namespace=self.namespace)

    def apply(self, config_text: str, settle_s: float = 1.5) -> None:
        import ray

        res = ray.get(self.broker().apply.remote(config_text), timeout=30)
        if not res.get("ok"):
            raise RuntimeError(f"broker apply refused the config: {res.get('issues')}")
        self.config_text = config_text
        time.sleep(settle_s)  # replicas pick the new settings up in their next report

    def settings(self) -> dict[str, Any]:
        code, doc = http_json(self.status_url)
        return (
            {
                n: {"max_batch_size": m["max_batch_size"], "batch_wait_timeout_s": m["batch_wait_timeout_s"]}
                for n, m in (doc or {}).get("models", {}).items()
            }
            if code == 200
            else {}
        )

    def delete(self) -> None:
        self.stack.delete(self.app)


@dataclass
class PlainTarget:
    stack: Stack
    app: str
    name: str
    base_url: str = ""
    kind: str = "plain"
    status_url: str | None = None
    load_base: str = ""  # under direct ingress: the ingress replica's own port

    @property
    def infer_base(self) -> str:
        return self.load_base or self.base_url

    def idle(self, timeout_s: float = 30.0) -> None:
        time.sleep(3.0)

    def delete(self) -> None:
        self.stack.delete(self.app)


# ------------------------------------------------------------------------------ one measurement
@dataclass
class Measurement:
    rate: float
    seed: int
    summary: dict[str, lg.ModelSummary]
    batch: dict[str, dict[str, Any]]
    status_samples: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    sent: int = 0
    records: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the broker's decisions during the run

    @property
    def passes(self) -> bool:
        return lg.all_pass(self.summary)

    @property
    def goodput_rps(self) -> float:
        return lg.total_goodput(self.summary)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rate": round(self.rate, 2),
            "seed": self.seed,
            "pass": self.passes,
            "goodput_rps": round(self.goodput_rps, 2),
            "wall_s": round(self.wall_s, 1),
        }
        out["models"] = {m: {**s.to_dict(), **self.batch.get(m, {})} for m, s in self.summary.items()}
        out.update(self.extra)
        return out


def measure(
    target: Any,
    schedule: Sequence[lg.Planned],
    duration_s: float,
    caps_ms: Mapping[str, float] | float,
    *,
    warmup_s: float,
    cooldown_s: float,
    rate: float = 0.0,
    seed: int = 0,
    poll: bool = True,
    status_every_s: float = 1.0,
    timeout_s: float = 20.0,
) -> Measurement:
    res = lg.run(
        getattr(target, "infer_base", target.base_url),
        schedule,
        timeout_s=timeout_s,
        status_url=getattr(target, "status_url", None) if poll else None,
        status_every_s=status_every_s,
    )
    missing = [r.idx for r in res.records if r.status == -1]
    if missing:
        raise RuntimeError(f"load generator lost {len(missing)} records (first {missing[:5]})")
    summ = lg.summarize(res.records, duration_s, caps_ms, warmup_s=warmup_s, cooldown_s=cooldown_s)
    batch = {m: lg.batch_stats(res.records, m, lo_s=warmup_s, hi_s=duration_s - cooldown_s) for m in summ}
    return Measurement(rate, seed, summ, batch, res.status_samples, res.wall_s, len(schedule), len(res.records))


# ------------------------------------------------------------------------------ knee search
def live_knee(
    run_rate: Callable[[float], Measurement],
    start_rate: float,
    *,
    step: float = 1.15,
    bisect_iters: int = 2,
    max_rate: float | None = None,
    max_runs: int = 12,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """λ_max of one target: largest rate whose run passes (attainment within the cap ≥ 0.99)."""
    rows: list[dict[str, Any]] = []

    def ok(rate: float) -> bool:
        m = run_rate(rate)
        row = m.row()
        rows.append(row)
        if on_row:
            on_row(row)
        return m.passes

    from gpubroker.sim.knee import search_knee

    return search_knee(ok, start_rate, step=step, bisect_iters=bisect_iters, max_rate=max_rate, max_runs=max_runs), rows


def decisions_since(
    target: Any, since_seq: int, model: str | None = None, kinds: tuple[str, ...] = ("settings",)
) -> tuple[list[dict[str, Any]], int]:
    """The broker's settings decisions after ``since_seq`` (GET /v1/decisions), compacted:
    time, trigger, reason, old and new batch cap / wait, and the load it acted on."""
    url = target.base_url + f"/v1/decisions?since_seq={int(since_seq)}" + (f"&model={model}" if model else "")
    try:
        code, doc = http_json(url)
    except Exception:  # noqa: BLE001 - decisions are diagnostics; a miss is not a failed run
        return [], since_seq
    if code != 200 or not isinstance(doc, list):
        return [], since_seq
    out = []
    seq = since_seq
    for e in doc:
        seq = max(seq, int(e.get("seq", 0)))
        if kinds and e.get("kind") not in kinds:
            continue
        old, new, inp = e.get("old") or {}, e.get("new") or {}, e.get("inputs") or {}
        if e.get("kind") != "settings":
            out.append(
                {
                    "seq": e.get("seq"),
                    "t_s": e.get("time_s"),
                    "kind": e.get("kind"),
                    "model": e.get("model"),
                    "reason": str(e.get("reason", ""))[:200],
                }
            )
            continue
        out.append(
            {
                "seq": e.get("seq"),
                "t_s": e.get("time_s"),
                "kind": "settings",
                "model": e.get("model"),
                "trigger": e.get("trigger"),
                "admit": (e.get("new") or {}).get("admit"),
                "reason": str(e.get("reason", ""))[:200],
                "old": {k: old.get(k) for k in ("max_batch_size", "batch_wait_timeout_s", "grant_bytes", "admit")},
                "new": {k: new.get(k) for k in ("max_batch_size", "batch_wait_timeout_s", "grant_bytes", "admit")},
                "rate_rps": inp.get("arrival_rate_rps"),
                "p95_ms": inp.get("p95_ms"),
                "queue_depth": inp.get("queue_depth"),
                "busy_frac": inp.get("busy_frac"),
            }
        )
    return out, seq
