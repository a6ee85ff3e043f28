"""Fleet commands: ``gpubroker up | status | apply | decisions | down`` (registered by broker/cli.py).

``up`` validates the config, starts a local Ray head (``ray start --head`` in its own
process group, so the fleet outlives the CLI and ``down`` stops exactly that cluster) unless
``--address``/``RAY_ADDRESS`` names one, starts the broker actor, deploys the Serve app and
returns once every model has answered a real request. What ``up`` started is recorded in a
state file (``~/.gpubroker/fleet.json``, or ``$GPUBROKER_STATE_DIR``) that the other commands
read. Read commands answer over HTTP (``/v1/status``, ``/v1/decisions``) when they can and
through Ray otherwise.

The functions above the commands (``start_local_ray``, ``deploy``, ``wait_serving``,
``teardown``...) are the library the demo and the integration tests use.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from quotas.config import ConfigError, FleetConfig, load_config, parse_config_text
from quotas.sizes import format_size

console = Console()
if not console.is_terminal:  # logs and pipes: wide enough for the status table
    console = Console(width=170)
err_console = Console(stderr=True)
APP_NAME = "gpubroker"
DEFAULT_CONFIG = Path("configs/demo.yaml")


class FleetError(RuntimeError):
    """Something the user must fix; printed without a traceback."""


# =============================================================================== state file
def state_dir() -> Path:
    return Path(os.environ.get("GPUBROKER_STATE_DIR") or Path.home() / ".gpubroker")


def state_path() -> Path:
    return state_dir() / "fleet.json"


def read_state() -> dict[str, Any] | None:
    try:
        return json.loads(state_path().read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def clear_state() -> None:
    try:
        state_path().unlink()
    except FileNotFoundError:
        pass


# =============================================================================== Ray
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def start_local_ray(num_cpus: int | None = None, port: int | None = None) -> dict[str, Any]:
    """``ray start --head`` on 127.0.0.1 in a new process group; every port picked free.

    Returns ``{"address", "pgid", "dashboard"}``; ``stop_local_ray(pgid)`` stops exactly it.
    """
    port = port if port and port_free(port) else free_port()
    dash = free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin) if ray_bin.exists() else "ray", "start", "--head",
        "--node-ip-address", "127.0.0.1", "--port", str(port),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
        "--ray-client-server-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--num-cpus", str(num_cpus or max(2, os.cpu_count() or 2)),
        "--disable-usage-stats",
    ]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    # A token left in ~/.ray/auth_token turns token auth on for `ray start` but not always for
    # the driver; the head binds 127.0.0.1 only, so unless the user chose a mode, keep it off.
    env.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])
    proc = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True, env=env)
    if proc.returncode != 0:
        raise FleetError(f"`ray start --head` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    # start_new_session: the CLI process was the group leader; its daemons keep its pgid.
    pgid = _pgid_of_gcs(port)
    return {"address": f"127.0.0.1:{port}", "pgid": pgid, "dashboard": f"http://127.0.0.1:{dash}"}


def _pgid_of_gcs(port: int) -> int | None:
    # -ww: without it ps cuts args at the terminal width (80 when piped), before the port flag
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and "gcs_server" in parts[2] and f"--gcs_server_port={port}" in parts[2]:
            return int(parts[1])
    return None


def stop_local_ray(pgid: int | None, timeout_s: float = 10.0) -> bool:
    """Stop the Ray cluster ``start_local_ray`` started: SIGTERM its process group, then SIGKILL."""
    if not pgid or pgid <= 1 or pgid == os.getpgid(0):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        time.sleep(0.5)
        if not _live_members(pgid):
            return True
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _live_members(pgid: int) -> int:
    """Processes of the group that are not zombies (exited daemons wait for init to reap them)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines()
               if len(line.split()) == 2 and line.split()[0] == str(pgid) and not line.split()[1].startswith("Z"))


def connect(address: str | None) -> None:
    """ray.init to a running cluster, quietly."""
    import ray

    if ray.is_initialized():
        return
    if address and address.startswith("127.0.0.1:"):
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as start_local_ray started it
    try:
        ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False, namespace=APP_NAME)
    except Exception as exc:  # noqa: BLE001
        raise FleetError(
            f"cannot connect to Ray at {address or 'auto'} ({exc}); is a fleet running? start one with `gpubroker up`"
        ) from None


def resolve_address(address: str | None) -> str | None:
    if address:
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    state = read_state()
    return state.get("address") if state else None


# =============================================================================== deploy
def example_inputs(cfg: FleetConfig) -> dict[str, Any]:
    """One valid input per model, from the adapter's ``example_input`` (no weights loaded)."""
    from deployments.models import resolve_model

    out = {}
    for name, spec in cfg.models.items():
        try:
            adapter = resolve_model(spec.model)(**spec.options)
            out[name] = adapter.example_input(None)
        except Exception:  # noqa: BLE001
            out[name] = {}
    return out


def deploy(cfg: FleetConfig, config_text: str, *, http_host: str | None = None, http_port: int | None = None,
           on_progress: Callable[[str, dict[str, Any]], None] | None = None, timeout_s: float = 600.0,
           model_num_cpus: float | None = None):
    """Start the broker and deploy the Serve app (Ray must be initialised). Returns the broker handle."""
    from ray import serve

    from broker.actor import start_broker
    from deployments.app import MODEL_NUM_CPUS, build_fleet

    notify = on_progress or (lambda stage, info: None)
    notify("broker", {})
    broker = start_broker(config_text)
    notify("broker-up", {})
    host = http_host or cfg.broker.http_host
    port = http_port or cfg.broker.http_port
    serve.start(http_options={"host": host, "port": port})
    app = build_fleet(cfg, config_text, model_num_cpus=model_num_cpus or MODEL_NUM_CPUS)
    serve._run(app, _blocking=False, name=APP_NAME, route_prefix="/",  # noqa: SLF001 - progress below
               logging_config={"enable_access_log": False})
    deadline = time.time() + timeout_s
    while True:
        st = serve.status().applications.get(APP_NAME)
        deployments = {n: d.status.value if hasattr(d.status, "value") else str(d.status)
                       for n, d in (st.deployments.items() if st else [])}
        app_status = (st.status.value if hasattr(st.status, "value") else str(st.status)) if st else "NOT_STARTED"
        notify("deploying", {"app": app_status, "deployments": deployments})
        if app_status == "RUNNING":
            break
        if app_status in ("DEPLOY_FAILED", "UNHEALTHY"):
            msg = st.message if st else ""
            raise FleetError(f"Serve app {app_status}: {msg[-3000:]}")
        if time.time() > deadline:
            raise FleetError(f"Serve app not running after {timeout_s:.0f}s: {deployments}")
        time.sleep(1.0)
    return broker


def wait_serving(cfg: FleetConfig, base_url: str, timeout_s: float = 300.0,
                 on_model: Callable[[str, int, float], None] | None = None) -> dict[str, float]:
    """POST one real request to every model until each answers 200; returns model -> ms."""
    import httpx

    inputs = example_inputs(cfg)
    done: dict[str, float] = {}
    deadline = time.time() + timeout_s
    last: dict[str, str] = {}
    with httpx.Client(timeout=60.0) as client:
        while len(done) < len(cfg.models):
            for name in cfg.models:
                if name in done:
                    continue
                t0 = time.time()
                try:
                    r = client.post(f"{base_url}/v1/models/{name}/infer", json={"input": inputs[name]})
                    code, last[name] = r.status_code, r.text[:300]
                except httpx.HTTPError as exc:
                    code, last[name] = 0, repr(exc)
                if code == 200:
                    done[name] = (time.time() - t0) * 1000.0
                    if on_model:
                        on_model(name, code, done[name])
            if len(done) < len(cfg.models):
                if time.time() > deadline:
                    missing = {n: last.get(n, "") for n in cfg.models if n not in done}
                    raise FleetError(f"models did not answer within {timeout_s:.0f}s: {missing}")
                time.sleep(0.5)
    return done


def teardown(cfg: FleetConfig | None = None, *, name: str = "gpubroker", namespace: str = "gpubroker") -> list[str]:
    """serve.shutdown() and kill the broker (no restart). Ray must be initialised."""
    import ray
    from ray import serve

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
    return done


# =============================================================================== rendering
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def status_table(st: dict[str, Any]) -> Table:
    title = (
        f"gpubroker {st.get('config_hash')}  profile {st.get('profile')} (${st.get('price_per_gpu_hour', 0):g}/h)"
        f"{'  DRY RUN' if st.get('dry_run') else ''}  granted {format_size(st.get('granted_bytes'))} of usable "
        f"{format_size(st.get('usable_bytes'))}  ticks {st.get('ticks')}"
    )
    table = Table(title=title)
    for col in ("model", "grant", "used", "max batch", "wait ms", "queue", "rps", "P95 ms", "SLO ms",
                "attain", "ver", "repl", "admit", "$/1k"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, m in st.get("models", {}).items():
        unit = " tok" if m.get("batch_unit") == "tokens" else ""
        grant = format_size(m["grant_bytes"])
        if m["grant_bytes"] > m.get("base_bytes", m["grant_bytes"]):
            grant = f"[green]{grant}[/]"
        elif m["grant_bytes"] < m.get("base_bytes", m["grant_bytes"]):
            grant = f"[yellow]{grant}[/]"
        att = m.get("attainment")
        cost = m.get("cost_per_1k_requests")
        table.add_row(
            name, grant, format_size(m["used_bytes"]), f"{m['max_batch_size']}{unit}",
            f"{m['batch_wait_timeout_s'] * 1000:.1f}", f"{m['queue_depth']:.0f}", f"{m['arrival_rate_rps']:.1f}",
            _ms(m.get("p95_ms")), _ms(m.get("slo_p95_ms")), "-" if att is None else f"{att:.1%}",
            str(m["settings_version"]), str(m["replicas"]), "yes" if m["admit"] else "[red]PAUSED[/]",
            "-" if cost is None else f"{cost:.4f}",
        )
    return table


def describe_decision(d: dict[str, Any]) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(d.get("time_s", 0))) + f".{int((d.get('time_s', 0) % 1) * 1000):03d}"
    kind = d.get("kind")
    if kind == "settings":
        old, new = d["old"], d["new"]
        parts = []
        for key, label in (("max_batch_size", "batch"), ("batch_wait_timeout_s", "wait_s"), ("grant_bytes", "grant"), ("admit", "admit")):
            if old[key] != new[key]:
                a, b = old[key], new[key]
                if key == "grant_bytes":
                    a, b = format_size(a), format_size(b)
                parts.append(f"{label} {a}->{b}")
        tv = d.get("trigger_value")
        trig = f"{d.get('trigger')}={tv:.3g}" if isinstance(tv, (int, float)) else f"{d.get('trigger')}"
        return f"#{d['seq']} {t} {d['model']}: {', '.join(parts) or 'no change'}  [{trig}]  {d.get('reason', '')}" + (
            " (dry run)" if d.get("dry_run") else "")
    if kind == "move":
        return (f"#{d['seq']} {t} quota {d['move']}: {d.get('donor') or 'pool'} -> {d.get('recipient') or 'pool'} "
                f"{format_size(d['amount_bytes'])}  {d.get('reason', '')}")
    return f"#{d['seq']} {t} [{kind}] {d.get('reason', '')}"


# =============================================================================== broker access
def _config_text_for(state: dict[str, Any] | None) -> str | None:
    return state.get("config_text") if state else None


def _http_get(path: str, timeout_s: float = 5.0) -> Any | None:
    state = read_state()
    if not state or not state.get("http_url"):
        return None
    import httpx

    try:
        r = httpx.get(state["http_url"] + path, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _broker_handle(address: str | None):
    import ray

    addr = resolve_address(address)
    if addr is None:
        raise FleetError("no fleet is running (no state file, no --address, no RAY_ADDRESS); start one with `gpubroker up`")
    connect(addr)
    state = read_state() or {}
    name, ns = state.get("broker_name", "gpubroker"), state.get("broker_namespace", "gpubroker")
    try:
        return ray.get_actor(name, namespace=ns)
    except ValueError:
        raise FleetError(f"no broker '{name}' in namespace '{ns}' at {addr}; start the fleet with `gpubroker up`") from None


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error[/] {exc}", highlight=False)
    raise typer.Exit(1)


# =============================================================================== commands
def up(
    config: Path = typer.Argument(DEFAULT_CONFIG, help="Fleet config YAML (default configs/demo.yaml)."),
    address: str = typer.Option(None, "--address", help="Ray cluster to use; default RAY_ADDRESS, else start a local one."),
    foreground: bool = typer.Option(False, "--foreground", help="Stay attached, print status, Ctrl-C tears down."),
    num_cpus: int = typer.Option(None, "--num-cpus", help="CPUs for a local Ray head (default: all)."),
    ray_port: int = typer.Option(0, "--ray-port", help="GCS port for a local Ray head (0 or taken: a free one)."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every model to answer."),
) -> None:
    """Start Ray (unless --address), the broker and the Serve app; return when every model answers."""
    try:
        text = config.read_text(encoding="utf-8")
        cfg = load_config(config)
    except ConfigError as exc:
        from broker.cli import print_config_error

        print_config_error(exc)
        raise typer.Exit(exc.exit_code)
    except OSError as exc:
        _fail(FleetError(f"cannot read {config}: {exc}"))
    existing = read_state()
    if existing and not address:
        _fail(FleetError(f"a fleet is already recorded in {state_path()} (Ray {existing.get('address')}); "
                         "run `gpubroker down` first"))
    try:
        up_fleet(cfg, text, str(config), address=address or os.environ.get("RAY_ADDRESS"), num_cpus=num_cpus,
                 ray_port=ray_port, timeout_s=timeout_s)
    except FleetError as exc:
        _fail(exc)
    if foreground:
        try:
            while True:
                time.sleep(5)
                st = _http_get("/v1/status")
                if st:
                    console.print(status_table(st))
        except KeyboardInterrupt:
            console.print("stopping...")
            down(address=None)


def up_fleet(cfg: FleetConfig, text: str, source: str, *, address: str | None = None, num_cpus: int | None = None,
             ray_port: int = 0, timeout_s: float = 600.0) -> dict[str, Any]:
    import ray

    t0 = time.time()
    state: dict[str, Any] = {"config": source, "config_text": text, "config_hash": cfg.config_hash(),
                             "broker_name": cfg.broker.name, "broker_namespace": cfg.broker.namespace,
                             "http_url": f"http://{cfg.broker.http_host}:{cfg.broker.http_port}",
                             "started_ray": False, "pgid": None, "address": address}
    n = len(cfg.models)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        t_ray = progress.add_task("Starting Ray", total=1)
        if address:
            progress.update(t_ray, description=f"Connecting to Ray at {address}")
        else:
            if not port_free(cfg.broker.http_port, cfg.broker.http_host):
                raise FleetError(f"HTTP port {cfg.broker.http_host}:{cfg.broker.http_port} is in use; "
                                 "set broker.http_port to a free port or stop what holds it")
            info = start_local_ray(num_cpus, ray_port)
            state.update(address=info["address"], pgid=info["pgid"], started_ray=True, dashboard=info["dashboard"])
            write_state(state)  # so `down` can clean up even if the rest fails
        try:
            connect(state["address"])
        except FleetError:
            if state["started_ray"]:
                stop_local_ray(state["pgid"])
                clear_state()
            raise
        progress.update(t_ray, completed=1, description=f"Ray at {state['address']}")
        t_broker = progress.add_task("Starting broker", total=1)
        t_deploy = progress.add_task("Loading models", total=n)
        t_cal = progress.add_task("Calibrating", total=n)
        t_req = progress.add_task("First requests", total=n)

        def on_progress(stage: str, info: dict[str, Any]) -> None:
            if stage == "broker-up":
                progress.update(t_broker, completed=1, description=f"Broker {cfg.broker.namespace}/{cfg.broker.name}")
            elif stage == "deploying":
                deps = info.get("deployments", {})
                healthy = sum(1 for k, v in deps.items() if k in cfg.models and v == "HEALTHY")
                progress.update(t_deploy, completed=healthy, description=f"Loading models ({info.get('app')})")
                try:
                    st = ray.get(broker_ref[0].status.remote(), timeout=5)
                    cal = sum(1 for m in st["models"].values() if m.get("calibrated"))
                    progress.update(t_cal, completed=cal)
                except Exception:  # noqa: BLE001
                    pass

        broker_ref: list[Any] = [None]
        from broker.actor import start_broker

        try:
            broker_ref[0] = start_broker(text)
            on_progress("broker-up", {})
            write_state(state)
            deploy(cfg, text, on_progress=on_progress, timeout_s=timeout_s)
            progress.update(t_deploy, completed=n, description="Models loaded")
            st = ray.get(broker_ref[0].status.remote(), timeout=10)
            progress.update(t_cal, completed=sum(1 for m in st["models"].values() if m.get("calibrated")))
            wait_serving(cfg, state["http_url"], timeout_s=timeout_s,
                         on_model=lambda name, code, ms: progress.advance(t_req))
            progress.update(t_cal, completed=n)
        except Exception as exc:
            console.print(f"[red]up failed[/]: {exc}; state kept in {state_path()}, run `gpubroker down` to clean up")
            raise
    state["up_s"] = round(time.time() - t0, 1)
    write_state(state)
    console.print(f"[green]fleet up[/] in {state['up_s']:.0f}s: {n} model(s) at {state['http_url']}/v1/models/<name>/infer; "
                  f"status: `gpubroker status`, stop: `gpubroker down`")
    return state


def _fetch_status(address: str | None) -> dict[str, Any]:
    """The broker's status over HTTP, else through Ray; raises (FleetError, Ray errors) instead of exiting."""
    st = None if address else _http_get("/v1/status")
    if st is None:
        import ray

        st = ray.get(_broker_handle(address).status.remote(), timeout=30)
    return st


def status(
    as_json: bool = typer.Option(False, "--json", help="Print the broker's status as JSON."),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Redraw the table every --interval seconds until Ctrl-C."),
    interval: float = typer.Option(2.0, "--interval", min=0.1, help="Seconds between refreshes with --watch."),
) -> None:
    """Per-model grant, used, max batch, wait, queue, P95, attainment and the active profile."""
    if watch:
        if as_json:
            _fail(FleetError("--watch draws a live table; use --json without --watch (e.g. in a loop) for JSON"))
        from broker.live import watch_status

        watch_status(lambda: _fetch_status(address), interval_s=interval, console=console)
        return
    st = None if address else _http_get("/v1/status")
    if st is None:
        try:
            import ray

            st = ray.get(_broker_handle(address).status.remote(), timeout=30)
        except FleetError as exc:
            _fail(exc)
    if as_json:
        print(json.dumps(st, indent=2))
        return
    console.print(status_table(st))


def apply(
    config: Path = typer.Argument(..., help="New fleet config YAML."),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Validate locally, then swap the running broker's config; exit 1 with the issues if refused."""
    try:
        text = config.read_text(encoding="utf-8")
        parse_config_text(text, str(config))
    except ConfigError as exc:
        from broker.cli import print_config_error

        print_config_error(exc)
        raise typer.Exit(exc.exit_code)
    except OSError as exc:
        _fail(FleetError(f"cannot read {config}: {exc}"))
    try:
        import ray

        result = ray.get(_broker_handle(address).apply.remote(text), timeout=60)
    except FleetError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result, indent=2))
    elif result["ok"]:
        console.print(f"[green]applied[/] config hash {result['config_hash']}")
        for note in result.get("notes", []):
            console.print(f"  note: {note}", highlight=False)
    else:
        err_console.print(f"[bold red]refused[/] (running config {result['config_hash']} unchanged):")
        for issue in result["issues"]:
            err_console.print(f"  - {issue}", markup=False, highlight=False)
    if result["ok"]:
        state = read_state()
        if state:
            state.update(config=str(config), config_text=text, config_hash=result["config_hash"])
            write_state(state)
    else:
        raise typer.Exit(1)


def _follow(first: list[dict[str, Any]], model: str | None, since: int, address: str | None, interval: float,
            as_json: bool) -> None:
    """Print ``first``, then poll the decision log and print each new entry (JSON lines with --json) until Ctrl-C."""
    from broker.live import follow_decisions, new_decisions

    def emit(d: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(d), flush=True)
        else:
            console.print(describe_decision(d), highlight=False, markup=False)

    def fetch(seq: int) -> list[dict[str, Any]]:
        out = None if address else _http_get(f"/v1/decisions?since_seq={seq}" + (f"&model={model}" if model else ""))
        if out is None:
            import ray

            out = ray.get(_broker_handle(address).decisions.remote(model, seq), timeout=30)
        return out

    last_error: list[str] = []

    def on_error(exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        if last_error[-1:] != [msg]:  # say it once, not every poll
            err_console.print(f"[yellow]broker unreachable[/] ({msg}); still polling every {interval:g}s", highlight=False)
        last_error[:] = [msg]

    fresh, seq = new_decisions(first, since)
    for d in fresh:
        emit(d)
    if not as_json:
        console.print(f"[dim]following the decision log after #{seq} every {interval:g}s, Ctrl-C to stop[/]")
    follow_decisions(fetch, emit, since_seq=seq, interval_s=interval, on_error=on_error)


def decisions(
    model: str = typer.Option(None, "--model", help="Only this model's decisions."),
    as_json: bool = typer.Option(False, "--json", help="Print the decisions as JSON (JSON lines with --follow)."),
    since: int = typer.Option(0, "--since", help="Only decisions after this sequence number."),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep polling and print new decisions as the broker makes them."),
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between polls with --follow."),
) -> None:
    """Each change the broker made, with its trigger metric and value."""
    query = f"/v1/decisions?since_seq={since}" + (f"&model={model}" if model else "")
    out = None if address else _http_get(query)
    if out is None:
        try:
            import ray

            out = ray.get(_broker_handle(address).decisions.remote(model, since), timeout=30)
        except FleetError as exc:
            _fail(exc)
    if follow:
        _follow(out, model, since, address, interval, as_json)
        return
    if as_json:
        print(json.dumps(out, indent=2))
        return
    if not out:
        console.print("no decisions yet")
    for d in out:
        console.print(describe_decision(d), highlight=False, markup=False)


def down(
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
) -> None:
    """Shut Serve down, kill the broker, and stop the local Ray that `up` started."""
    state = read_state()
    addr = resolve_address(address)
    if addr is None:
        _fail(FleetError("no fleet is running (no state file, no --address, no RAY_ADDRESS); nothing to stop"))
    cfg = None
    if state and state.get("config_text"):
        try:
            cfg = parse_config_text(state["config_text"])
        except ConfigError:
            cfg = None
    try:
        connect(addr)
        for line in teardown(cfg):
            console.print(line)
        import ray

        ray.shutdown()
    except FleetError as exc:
        if not (state and state.get("started_ray")):
            _fail(exc)
        console.print(f"[yellow]{exc}[/]")
    if state and state.get("started_ray") and not address:
        pgid = state.get("pgid")
        if not pgid and state.get("address"):  # not found at start: look the cluster up by its GCS port now
            pgid = _pgid_of_gcs(int(str(state["address"]).rsplit(":", 1)[-1]))
        if stop_local_ray(pgid):
            console.print(f"local Ray {state.get('address')} stopped")
        else:
            console.print(f"[yellow]could not find the processes of local Ray {state.get('address')}; "
                          "stop it with `ray stop` if nothing else uses Ray here[/]")
    if state and (not address or address == state.get("address")):
        clear_state()
    console.print("[green]fleet down[/]")
