"""The fleet's lifecycle, without a UI: deploy, wait for the models, teardown, ``up`` and ``down``.

``up_fleet`` validates nothing (the caller loads the config), starts a local Ray head
(``gpubroker.deployments.cluster.local_ray``) unless an address names one, starts the broker actor, deploys the
Serve app and returns once every model has answered a real request. What it started goes to
the state file (``gpubroker.deployments.cluster.fleet_client``) that the other commands read. Progress goes to
an ``on_event`` callback as ``UpEvent``s (the CLI draws them with rich; the demo and tests
can pass nothing); ``down_fleet`` reports each step to a callback too.

Ray, Serve and httpx are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gpubroker.broker.client import BrokerClient, blocking
from gpubroker.deployments.cluster.fleet_client import (
    APP_NAME,
    clear_state,
    connect,
    read_state,
    resolve_address,
    write_state,
)
from gpubroker.deployments.cluster.local_ray import FleetError, pgid_of_gcs, port_free, start_local_ray, stop_local_ray
from gpubroker.deployments.serve.failures import failure_cause, serve_log_dir, where_to_look
from gpubroker.quotas.config import ConfigError, FleetConfig, parse_config_text

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from gpubroker.broker.actor import BrokerActor
    from gpubroker.deployments.cluster.user_code import ProjectCheck


# =============================================================================== deploy
def example_inputs(cfg: FleetConfig) -> dict[str, Any]:
    """One valid input per model, from the adapter's ``example_input`` (no weights loaded)."""
    from gpubroker.deployments.models import resolve_model

    out = {}
    for name, spec in cfg.models.items():
        try:
            adapter = resolve_model(spec.model)(**spec.options)
            out[name] = adapter.example_input(None)
        except Exception:  # noqa: BLE001
            out[name] = {}
    return out


def proxy_location(nodes: list[dict[str, Any]] | None = None) -> str:
    """Serve's proxies: one per node (``EveryNode``), or on the head only (``HeadOnly``) when two
    alive Ray nodes share an address: two ``ray start`` nodes on one machine would bind the
    same HTTP port, and the second proxy would never start."""
    if nodes is None:
        import ray

        nodes = ray.nodes()
    addresses = [n.get("NodeManagerAddress") for n in nodes if n.get("Alive", True)]
    return "HeadOnly" if len(addresses) != len(set(addresses)) else "EveryNode"


def deploy(
    cfg: FleetConfig,
    config_text: str,
    *,
    http_host: str | None = None,
    http_port: int | None = None,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
    timeout_s: float = 600.0,
    model_num_cpus: float | None = None,
):
    """Start the broker and deploy the Serve app (Ray must be initialised). Returns the broker handle."""
    from ray import serve

    from gpubroker.broker.actor import start_broker
    from gpubroker.deployments.app import MODEL_NUM_CPUS, AppLayout, fleet_apps, http_options, run_fleet
    from gpubroker.deployments.serve.reconcile import ServeReconciler

    notify = on_progress or (lambda stage, info: None)
    cards = None
    if cfg.gpus == "auto":  # every GPU of every node, found once here; the broker and placement get the same list
        from gpubroker.deployments.cluster.discovery import discover_cards

        cards = tuple(discover_cards())
    notify("broker", {})
    broker = start_broker(config_text, cards=cards)
    notify("broker-up", {})
    host = http_host or cfg.broker.http_host
    port = http_port or cfg.broker.http_port
    serve.start(proxy_location=proxy_location(), http_options=http_options(cfg, host, port))
    # one Serve app per model (its own ingress, one hop from the proxy) and the fleet API
    num_cpus = model_num_cpus or MODEL_NUM_CPUS
    # many cards: the fleet API applies the broker's re-placements to Serve (gpubroker.deployments.serve.follow)
    follow = (
        ServeReconciler(cfg, config_text, cards=cards, fleet_app=APP_NAME, model_num_cpus=num_cpus)
        if cfg.gpus is not None
        else None
    )
    layout = AppLayout(fleet_app=APP_NAME, model_num_cpus=num_cpus)
    apps = fleet_apps(cfg, config_text, layout, cards=cards, reconciler=follow)
    run_fleet(apps, logging_config={"enable_access_log": False})  # not waiting: progress below
    deadline = time.time() + timeout_s
    while True:
        every = serve.status().applications
        sts = {a.name: every.get(a.name) for a in apps}
        deployments = {
            n: d.status.value if hasattr(d.status, "value") else str(d.status)
            for st in sts.values()
            if st
            for n, d in st.deployments.items()
        }
        states = {
            name: (st.status.value if hasattr(st.status, "value") else str(st.status)) if st else "NOT_STARTED"
            for name, st in sts.items()
        }
        failed = {name: s for name, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        app_status = next(iter(failed.values()), None) or (
            "RUNNING" if all(s == "RUNNING" for s in states.values()) else "DEPLOYING"
        )
        notify("deploying", {"app": app_status, "deployments": deployments})
        if app_status == "RUNNING":
            break
        if failed:
            raise FleetError(f"Serve app {app_status}: {failure_cause(sts)}")
        if time.time() > deadline:
            raise FleetError(f"Serve app not running after {timeout_s:.0f}s: {deployments}")
        time.sleep(1.0)
    return broker


def first_examples(cfg: FleetConfig) -> dict[str, tuple[bool, Any, str]]:
    """Per model: (has an ``example_input``, the input, why not); no weights loaded. A model
    whose class cannot be imported or constructed with its options here is a ``FleetError``
    naming it: its replicas would fail the same way, and `up` must not report the fleet up."""
    from gpubroker.deployments.cluster.first_requests import example_of
    from gpubroker.deployments.models import resolve_model

    out = {}
    for name, spec in cfg.models.items():
        if spec.kind == "llm":  # asked for one token on the OpenAI route (first_request)
            out[name] = (True, LLM_FIRST_PROMPT, "")
            continue
        try:
            adapter = resolve_model(spec.model)(**spec.options)
        except Exception as exc:  # noqa: BLE001 - any failure to build is the user's to fix, named
            raise FleetError(
                f"model '{name}' ({spec.model}) cannot be built: {exc}. Fix models.{name}.model or "
                f"models.{name}.options; a class in your own package needs `gpubroker up` run from the "
                "directory that holds the package, or the package installed (pip install -e .)"
            ) from exc
        out[name] = example_of(adapter)
    return out


LLM_FIRST_PROMPT = "Hello"  # an LLM's first request: one token of a completion, as a client would ask


def first_request(cfg: FleetConfig, name: str, example: Any) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of a model's first request: its example on /v1/models/<name>/infer, or
    for an LLM a one-token completion on the fleet's OpenAI route."""
    if cfg.models[name].kind == "llm":
        return "/openai/v1/completions", {"model": name, "prompt": example, "max_tokens": 1}
    return f"/v1/models/{name}/infer", {"input": example}


def wait_serving(
    cfg: FleetConfig,
    base_url: str,
    timeout_s: float = 300.0,
    on_model: Callable[[str, int, float], None] | None = None,
    on_answer: Callable[[Any], None] | None = None,
    *,
    wait_s: float | None = None,
    examples: dict[str, tuple[bool, Any, str]] | None = None,
) -> dict[str, float]:
    """POST one real request (its ``example_input``; an LLM: a one-token completion) to every model until each answers 200;
    returns model -> ms. A model without ``example_input`` is skipped; one that keeps refusing,
    or has no 200 within ``wait_s`` (default ``first_requests.WAIT_S``), stops the wait with its
    last answer and the fix (``gpubroker.deployments.cluster.first_requests``). ``on_answer`` gets the
    ``FirstRequests`` record after every answer (each model's last answer); ``examples``:
    ``first_examples(cfg)`` when the caller already has it."""
    import httpx

    from gpubroker.deployments.cluster.first_requests import WAIT_S, FirstRequests

    first = FirstRequests.for_examples(examples or first_examples(cfg), WAIT_S if wait_s is None else wait_s)
    done: dict[str, float] = {}
    deadline = time.time() + timeout_s
    if on_answer:
        on_answer(first)
    with httpx.Client(timeout=60.0) as client:
        while first.asking():
            for name in first.asking():
                t0 = time.time()
                path, body = first_request(cfg, name, first.models[name].example)
                try:
                    r = client.post(f"{base_url}{path}", json=body)
                    code, text = r.status_code, r.text[:300]
                except httpx.HTTPError as exc:
                    code, text = 0, repr(exc)
                first.record(name, code, text, time.time())
                if code == 200:
                    done[name] = (time.time() - t0) * 1000.0
                    if on_model:
                        on_model(name, code, done[name])
                if on_answer:
                    on_answer(first)
            refused = first.refused()
            if refused:
                raise FleetError(refused)
            if first.asking():
                if time.time() > deadline:
                    missing = {n: f"{first.models[n].last_code} {first.models[n].last_text}" for n in first.asking()}
                    raise FleetError(f"models did not answer within {timeout_s:.0f}s: {missing}")
                time.sleep(0.5)
    return done


def teardown(cfg: FleetConfig | None = None, *, name: str = "gpubroker", namespace: str = "gpubroker") -> list[str]:
    """serve.shutdown(), kill the broker (no restart) and the nodes' watch agents. Ray must be initialised."""
    import ray
    from ray import serve

    from gpubroker.deployments.enforce.agent import stop_agents

    done = []
    try:
        serve.shutdown()
        done.append("serve shut down")
    except Exception as exc:  # noqa: BLE001
        done.append(f"serve.shutdown failed: {exc!r}")
    if cfg is not None:
        name, namespace = cfg.broker.name, cfg.broker.namespace
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        done.append(f"broker {namespace}/{name} killed")
    except ValueError:
        done.append("no broker running")
    done += stop_agents(namespace)
    return done


# =============================================================================== up
class UpStage(StrEnum):
    """The steps of ``up_fleet``, in order; ``FAILED`` says the fleet stopped half-way."""

    RAY = "ray"
    BROKER = "broker"
    MODELS = "models"
    CALIBRATION = "calibration"
    REQUESTS = "requests"
    FAILED = "failed"


@dataclass(frozen=True)
class UpEvent:
    """One step of ``up_fleet`` moved: a UI shows one line (a bar) per stage."""

    stage: UpStage
    label: str | None = None  # what the stage is doing now; None keeps the last label
    done: int | None = None  # units of the stage finished; None keeps the last count
    total: int = 1  # units in the stage (1, or one per model)


@dataclass(frozen=True)
class UpOptions:
    """Where and how ``up_fleet`` brings a fleet up (the ``gpubroker up`` options)."""

    address: str | None = None  # a running Ray cluster; None starts a local head
    num_cpus: int | None = None  # CPUs of a local head (None: all)
    ray_port: int = 0  # GCS port of a local head (0: a free one)
    timeout_s: float = 600.0  # for the Serve apps to run and every model to answer
    wait_s: float | None = None  # how long a model may go without a 200 (None: first_requests.WAIT_S)
    project_dir: str | None = None  # where the user's model packages live (None: the current directory)


def up_fleet(
    cfg: FleetConfig,
    text: str,
    source: str,
    opts: UpOptions = UpOptions(),
    on_event: Callable[[UpEvent], None] | None = None,
) -> dict[str, Any]:
    """Ray (local unless ``opts.address``), broker, Serve app, one answered request per model; returns the state.

    Before Ray starts, every model is built here (``first_examples``) from ``opts.project_dir``
    (``gpubroker.deployments.cluster.user_code``): a model that cannot be built, or a project folder that shadows one
    of gpubroker's packages under a model path, stops ``up`` at once. The user's packages found
    there are shipped to the replicas (Ray ``py_modules``). The state file is written as soon as
    a local Ray is up, so ``down_fleet`` can clean up after a failure; a failure after that emits
    ``UpStage.FAILED`` with the error and re-raises.
    """
    emit = on_event or (lambda event: None)
    t0 = time.time()
    project = _checked_project(cfg, opts.project_dir)
    examples = first_examples(cfg)  # every model builds here, or up stops naming it
    state = _first_state(cfg, text, source, opts.address, project)
    _start_ray(cfg, state, opts, project, emit)
    progress = _UpProgress(cfg, emit)
    try:
        _start_broker_and_models(cfg, text, state, opts, progress)
        wait_serving(
            cfg,
            state["http_url"],
            timeout_s=opts.timeout_s,
            on_answer=progress.on_answer,
            wait_s=opts.wait_s,
            examples=examples,
        )
        progress.calibration(len(cfg.models))
        if cfg.broker.direct_ingress:  # each replica's own port (gpubroker.deployments.serve.direct_ingress)
            _list_direct_urls(cfg, state)
    except Exception as exc:
        log_dir = serve_log_dir(state.get("session_dir"))
        emit(UpEvent(UpStage.FAILED, f"{exc}\n{where_to_look(state.get('dashboard'), log_dir)}"))
        raise
    state["up_s"] = round(time.time() - t0, 1)
    write_state(state)
    return state


def _checked_project(cfg: FleetConfig, project_dir: str | None) -> ProjectCheck:
    """The user's project, put on this process's path; a collision with our packages is a FleetError."""
    from gpubroker.deployments.cluster.user_code import check_project, on_sys_path

    project = check_project(((n, m.model) for n, m in cfg.models.items() if m.kind != "llm"), project_dir)
    if project.errors:
        raise FleetError("; ".join(project.errors))
    on_sys_path(project.project_dir)
    return project


def _first_state(
    cfg: FleetConfig, text: str, source: str, address: str | None, project: ProjectCheck
) -> dict[str, Any]:
    """The state file's content before anything started."""
    return {
        "config": source,
        "config_text": text,
        "config_hash": cfg.config_hash(),
        "broker_name": cfg.broker.name,
        "broker_namespace": cfg.broker.namespace,
        "http_url": f"http://{cfg.broker.http_host}:{cfg.broker.http_port}",
        "started_ray": False,
        "pgid": None,
        "address": address,
        "shipped": list(project.py_modules),  # the user's packages sent to the replicas
        "project_warnings": list(project.warnings),
    }


def _start_ray(
    cfg: FleetConfig, state: dict[str, Any], opts: UpOptions, project: ProjectCheck, emit: Callable[[UpEvent], None]
) -> None:
    """Connect to Ray at ``opts.address`` or to a local head started here (recorded in the state
    file at once), shipping the user's packages; a listed gpus: fleet needs its cards there."""
    emit(UpEvent(UpStage.RAY, "Starting Ray", 0, 1))
    if opts.address:
        emit(UpEvent(UpStage.RAY, f"Connecting to Ray at {opts.address}", total=1))
    else:
        _start_local_head(cfg, state, opts)
    try:
        connect(state["address"], runtime_env=project.runtime_env())  # the user's packages, to every replica
    except FleetError:
        if state["started_ray"]:
            stop_local_ray(state["pgid"])
            clear_state()
        raise
    where = _check_cards(cfg, state)
    emit(UpEvent(UpStage.RAY, f"Ray at {state['address']}{where}", 1, 1))


def _start_local_head(cfg: FleetConfig, state: dict[str, Any], opts: UpOptions) -> None:
    if not port_free(cfg.broker.http_port, cfg.broker.http_host):
        raise FleetError(
            f"HTTP port {cfg.broker.http_host}:{cfg.broker.http_port} is in use; "
            "set broker.http_port to a free port or stop what holds it"
        )
    info = start_local_ray(opts.num_cpus, opts.ray_port, direct_ingress=cfg.broker.direct_ingress)
    state.update(
        address=info["address"],
        pgid=info["pgid"],
        started_ray=True,
        dashboard=info["dashboard"],
        session_dir=info["session_dir"],
        auth_mode=info["auth_mode"],
        join=info["join"],
    )
    write_state(state)  # so `down` can clean up even if the rest fails


class _UpProgress:
    """``up_fleet``'s events for the broker, model and calibration bars, from ``deploy``'s
    progress and the broker's status, and for the first requests, from their answers."""

    def __init__(self, cfg: FleetConfig, emit: Callable[[UpEvent], None]) -> None:
        self.cfg = cfg
        self.emit = emit
        self.n = len(cfg.models)
        self.broker: ActorHandle[BrokerActor] | None = None  # the broker's handle, once it started
        emit(UpEvent(UpStage.BROKER, "Starting broker", 0, 1))
        emit(UpEvent(UpStage.MODELS, "Loading models", 0, self.n))
        emit(UpEvent(UpStage.CALIBRATION, "Calibrating", 0, self.n))
        emit(UpEvent(UpStage.REQUESTS, "First requests", 0, self.n))

    def calibrated(self, timeout_s: float) -> int:
        """How many models the broker has calibrated."""
        assert self.broker is not None, "the broker starts before calibration is read"
        st = blocking(BrokerClient(self.broker, timeout_s).status())
        return sum(1 for m in st["models"].values() if m.get("calibrated"))

    def calibration(self, done: int) -> None:
        self.emit(UpEvent(UpStage.CALIBRATION, done=done, total=self.n))

    def on_deploy(self, stage: str, info: dict[str, Any]) -> None:
        """``deploy``'s ``on_progress``: the broker is up, or the Serve apps moved."""
        if stage == "broker-up":
            self.emit(UpEvent(UpStage.BROKER, f"Broker {self.cfg.broker.namespace}/{self.cfg.broker.name}", 1, 1))
        elif stage == "deploying":
            deps = info.get("deployments", {})
            healthy = sum(1 for k, v in deps.items() if k in self.cfg.models and v == "HEALTHY")
            self.emit(UpEvent(UpStage.MODELS, f"Loading models ({info.get('app')})", healthy, self.n))
            try:
                self.calibration(self.calibrated(5))
            except Exception:  # noqa: BLE001 - the broker may not answer yet; the count waits
                pass

    def on_answer(self, first: Any) -> None:
        """``wait_serving``'s ``on_answer``: each model's last answer, in the bar's label."""
        self.emit(UpEvent(UpStage.REQUESTS, first.label(), done=first.settled(), total=self.n))


def _start_broker_and_models(
    cfg: FleetConfig, text: str, state: dict[str, Any], opts: UpOptions, progress: _UpProgress
) -> None:
    """The broker actor, then the Serve apps, until every model's deployment runs."""
    from gpubroker.broker.actor import start_broker

    progress.broker = start_broker(text)
    progress.on_deploy("broker-up", {})
    write_state(state)
    deploy(cfg, text, on_progress=progress.on_deploy, timeout_s=opts.timeout_s)
    progress.emit(UpEvent(UpStage.MODELS, "Models loaded", progress.n, progress.n))
    progress.calibration(progress.calibrated(10))


def _list_direct_urls(cfg: FleetConfig, state: dict[str, Any]) -> None:
    """broker.direct_ingress: each model's replica ports into the state (or why there are none)."""
    from gpubroker.deployments.app import model_app_name
    from gpubroker.deployments.serve.direct_ingress import wait_model_urls

    apps = {name: model_app_name(name) for name, spec in cfg.models.items() if spec.kind != "llm"}
    try:
        state["direct_urls"] = wait_model_urls(apps, cfg.broker.http_host)
    except Exception as exc:  # noqa: BLE001 - the fleet is up; only the listing failed
        state["direct_urls"] = {name: [] for name in apps}
        state["direct_error"] = f"could not list the replica ports: {exc!r}; GET /v1/models lists them"


def _check_cards(cfg: FleetConfig, state: dict[str, Any], nodes: list[dict[str, Any]] | None = None) -> str:
    """A listed gpus: fleet needs its cards' Ray resources on the cluster's nodes. None declared:
    a FleetError naming the ``ray start`` lines (a local Ray that ``up`` started is stopped
    again). Some missing: what the progress line says (their replicas wait for the node, or
    move once the broker marks the card lost)."""
    if not isinstance(cfg.gpus, list):
        return ""
    from gpubroker.deployments.cluster.discovery import missing_cards, missing_cards_fix

    missing = missing_cards(cfg.gpus, nodes)
    if len(missing) < len(cfg.gpus):
        return f" (cards {', '.join(c.id for c in missing)} on no node yet)" if missing else ""
    if state["started_ray"]:
        stop_local_ray(state["pgid"])
        clear_state()
        where = "the local Ray that `gpubroker up` started declares none of them"
    else:
        where = f"no node of the Ray cluster at {state['address']} declares any of them"
    raise FleetError(
        f"the config lists cards {', '.join(c.id for c in cfg.gpus)} (gpus:), each a Ray resource "
        f"gpubroker_card_<id> on its node, and {where}. Start the nodes with their cards "
        f"({missing_cards_fix(cfg.gpus, state['address'] if not state['started_ray'] else 'HEAD:6379')}; "
        "the head with --head instead of --address), then `gpubroker up CONFIG --address HEAD:6379` "
        "(README: A cluster of several cards)"
    )


# =============================================================================== down
class Note(StrEnum):
    """How a line of ``down_fleet``'s report reads: a step done, or a warning."""

    DONE = "done"
    WARN = "warn"


def down_fleet(address: str | None, report: Callable[[str, Note], None]) -> None:
    """Shut Serve down, kill the broker and stop the local Ray that ``up_fleet`` started; each step is reported.

    Raises FleetError when there is no fleet, or when Ray cannot be reached and this state file
    did not start it (then there is nothing of ours to stop).
    """
    state = read_state()
    addr = resolve_address(address)
    if addr is None:
        raise FleetError("no fleet is running (no state file, no --address, no RAY_ADDRESS); nothing to stop")
    cfg = None
    if state and state.get("config_text"):
        try:  # text read back from the state file ``up`` wrote: an input here, parsed once for teardown
            cfg = parse_config_text(state["config_text"])
        except ConfigError:
            cfg = None
    try:
        connect(addr)
        for line in teardown(cfg):
            report(line, Note.DONE)
        import ray

        ray.shutdown()
    except FleetError as exc:
        if not (state and state.get("started_ray")):
            raise
        report(str(exc), Note.WARN)
    if state and state.get("started_ray") and not address:
        pgid = state.get("pgid")
        if not pgid and state.get("address"):  # not found at start: look the cluster up by its GCS port now
            pgid = pgid_of_gcs(int(str(state["address"]).rsplit(":", 1)[-1]))
        if stop_local_ray(pgid):
            report(f"local Ray {state.get('address')} stopped", Note.DONE)
        else:
            report(
                f"could not find the processes of local Ray {state.get('address')}; "
                "stop it with `ray stop` if nothing else uses Ray here",
                Note.WARN,
            )
    if state and (not address or address == state.get("address")):
        clear_state()
