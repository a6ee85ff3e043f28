"""Fleet commands: ``gpubroker up | status | apply | decisions | down``.

The lifecycle itself (local Ray, deploy, teardown) is ``gpubroker.deployments.cluster.fleet``, the state file and
the broker's API ``gpubroker.deployments.cluster.fleet_client``; this module parses the options, draws ``up``'s
progress with rich and prints tables.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from gpubroker.broker.wire import DecisionRecord
from gpubroker.cli.demo import DEMO_HELP, config_or_demo
from gpubroker.cli.live import follow_decisions, new_decisions, watch_status
from gpubroker.cli.views import describe_decision, err_console, fleet_view, print_config_error, status_table
from gpubroker.deployments.cluster import fleet, fleet_client
from gpubroker.deployments.cluster.first_requests import WAIT_S
from gpubroker.deployments.cluster.fleet import FleetError, Note, UpEvent, UpOptions, UpStage
from gpubroker.deployments.cluster.user_code import check_project
from gpubroker.deployments.serve.failures import replica_logs, serve_log_dir
from gpubroker.quotas.config import ConfigError, FleetConfig, load_config, parse_config_text
from gpubroker.quotas.config_errors import did_you_mean
from gpubroker.sizing import quota_warnings

console = Console()
if not console.is_terminal:  # logs and pipes: wide enough for the status table
    console = Console(width=170)


def _fail(exc: Exception) -> NoReturn:
    err_console.print(f"[bold red]error[/] {exc}", highlight=False)
    raise typer.Exit(1)


# =============================================================================== up
class UpBars:
    """Draws ``up_fleet``'s events: one rich progress bar per stage, added on its first event."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[UpStage, TaskID] = {}

    def __call__(self, event: UpEvent) -> None:
        if event.stage is UpStage.FAILED:
            console.print(
                f"[red]up failed[/]: {event.label}; state kept in {fleet_client.state_path()}, "
                "run `gpubroker down` to clean up"
            )
            return
        task = self.tasks.get(event.stage)
        if task is None:
            self.tasks[event.stage] = self.progress.add_task(
                event.label or event.stage.value, total=event.total, completed=event.done or 0
            )
            return
        update: dict[str, Any] = {}
        if event.label is not None:
            update["description"] = event.label
        if event.done is not None:
            update["completed"] = event.done
        self.progress.update(task, **update)


def up_with_progress(cfg: FleetConfig, text: str, source: str, opts: UpOptions | None = None) -> dict[str, Any]:
    """``gpubroker.deployments.cluster.fleet.up_fleet`` with its progress drawn, then the line saying where the fleet answers."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        state = fleet.up_fleet(cfg, text, source, opts or UpOptions(), on_event=UpBars(progress))
    llms = sorted(n for n, m in cfg.models.items() if m.kind == "llm")
    batch = len(cfg.models) - len(llms)
    where = [f"{batch} model(s) at {state['http_url']}/v1/models/<name>/infer"] if batch else []
    if llms:
        where.append(f"LLM(s) {', '.join(llms)} on the OpenAI API at {state['http_url']}/openai/v1")
    console.print(
        f"[green]fleet up[/] in {state['up_s']:.0f}s: {'; '.join(where)}; status: `gpubroker status`, "
        "stop: `gpubroker down`"
    )
    if state.get("dashboard"):
        console.print(f"  Ray dashboard: {state['dashboard']}", highlight=False)
    if state.get("shipped"):
        console.print(f"  shipped to the replicas: {', '.join(state['shipped'])}", highlight=False)
    if "direct_urls" in state:  # broker.direct_ingress: each replica's own port, no proxy hop
        urls = state["direct_urls"]
        if any(urls.values()):
            for name, found in urls.items():
                console.print(f"  {name} direct: {', '.join(found) or '(no replica port yet)'}", highlight=False)
        else:
            from gpubroker.deployments.serve.direct_ingress import not_enabled_hint

            console.print(f"[yellow]warning:[/] {state.get('direct_error') or not_enabled_hint()}", highlight=False)
    if state.get("join"):  # a Ray that up started: token auth and how another node joins it
        console.print(
            f"Ray {state['address']} (auth: {state.get('auth_mode')}); {state['join']}", highlight=False, markup=False
        )
    return state


def up(
    config: Path | None = typer.Argument(
        None, help="Fleet config YAML (default: the demo fleet shipped in the package, as --demo)."
    ),
    demo: bool = typer.Option(False, "--demo", help=DEMO_HELP),
    address: str = typer.Option(
        None, "--address", help="Ray cluster to use; default RAY_ADDRESS, else start a local one."
    ),
    foreground: bool = typer.Option(False, "--foreground", help="Stay attached, print status, Ctrl-C tears down."),
    num_cpus: int = typer.Option(None, "--num-cpus", help="CPUs for a local Ray head (default: all)."),
    ray_port: int = typer.Option(0, "--ray-port", help="GCS port for a local Ray head (0 or taken: a free one)."),
    timeout_s: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every model to answer."),
    wait_s: float = typer.Option(
        WAIT_S,
        "--wait",
        min=1.0,
        help="Seconds a model may go without a 200 on its first request before `up` stops, naming it.",
    ),
) -> None:
    """Start Ray (unless --address), the broker and the Serve app; return when every model answers.

    Run it from your project's directory: a model `mypkg.models:MyModel` is imported from there,
    and `mypkg/` is shipped to the replicas."""
    config = config_or_demo(config, demo, default_demo=True)
    try:
        text = config.read_text(encoding="utf-8")
        cfg = load_config(config)
    except ConfigError as exc:
        print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        _fail(FleetError(f"cannot read {config}: {exc}"))
    existing = fleet_client.read_state()
    if existing and not address:
        _fail(
            FleetError(
                f"a fleet is already recorded in {fleet_client.state_path()} (Ray {existing.get('address')}); "
                "run `gpubroker down` first"
            )
        )
    project = check_project((n, m.model) for n, m in cfg.models.items() if m.kind != "llm")
    for warning in [*project.warnings, *quota_warnings(cfg)]:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    try:
        up_with_progress(
            cfg,
            text,
            str(config),
            UpOptions(
                address=address or os.environ.get("RAY_ADDRESS"),
                num_cpus=num_cpus,
                ray_port=ray_port,
                timeout_s=timeout_s,
                wait_s=wait_s,
            ),
        )
    except FleetError as exc:
        _fail(exc)
    if foreground:
        try:
            while True:
                time.sleep(5)
                st = fleet_client.http_get("/v1/status")
                if st:
                    console.print(status_table(st))
        except KeyboardInterrupt:
            console.print("stopping...")
            down(address=None)


# =============================================================================== read commands
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
        watch_status(lambda: fleet_client.fetch_status(address), interval_s=interval, console=console)
        return
    try:
        st = fleet_client.fetch_status(address)
    except FleetError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(st, indent=2))
        return
    for table in fleet_view(st):
        console.print(table)


def _follow(
    first: list[DecisionRecord], model: str | None, since: int, address: str | None, interval: float, as_json: bool
) -> None:
    """Print ``first``, then poll the decision log and print each new entry (JSON lines with --json) until Ctrl-C."""

    def emit(d: Mapping[str, Any]) -> None:
        if as_json:
            print(json.dumps(d), flush=True)
        else:
            console.print(describe_decision(d), highlight=False, markup=False)

    last_error: list[str] = []

    def on_error(exc: Exception) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        if last_error[-1:] != [msg]:  # say it once, not every poll
            err_console.print(
                f"[yellow]broker unreachable[/] ({msg}); still polling every {interval:g}s", highlight=False
            )
        last_error[:] = [msg]

    fresh, seq = new_decisions(first, since)
    for d in fresh:
        emit(d)
    if not as_json:
        console.print(f"[dim]following the decision log after #{seq} every {interval:g}s, Ctrl-C to stop[/]")
    follow_decisions(
        lambda s: fleet_client.fetch_decisions(address, model, s),
        emit,
        since_seq=seq,
        interval_s=interval,
        on_error=on_error,
    )


def _known_model(model: str, st: Mapping[str, Any]) -> None:
    """Refuse a model the running fleet does not have (exit 1), naming the closest and the ones it has."""
    names = sorted(st.get("models", {}))
    if model not in names:
        hint = did_you_mean(model, names)
        _fail(FleetError(f"no model '{model}' in the running fleet;{hint} its models: {', '.join(names) or 'none'}"))


def decisions(
    model: str = typer.Option(None, "--model", help="Only this model's decisions."),
    as_json: bool = typer.Option(False, "--json", help="Print the decisions as JSON (JSON lines with --follow)."),
    since: int = typer.Option(0, "--since", help="Only decisions after this sequence number."),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep polling and print new decisions as the broker makes them."
    ),
    interval: float = typer.Option(1.0, "--interval", min=0.1, help="Seconds between polls with --follow."),
) -> None:
    """Each change the broker made, with its trigger metric and value."""
    try:
        if model is not None:
            _known_model(model, fleet_client.fetch_status(address))
        out = fleet_client.fetch_decisions(address, model, since)
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


def logs(
    model: str = typer.Argument(..., help="The model whose replicas' log lines to show."),
    lines: int = typer.Option(40, "--lines", "-n", min=1, help="Lines from the end of each replica's log."),
) -> None:
    """The recent log lines of a model's replicas on this node (Serve's replica logs of the fleet `up` started)."""
    state = fleet_client.read_state()
    if state and state.get("config_text"):
        names = sorted(parse_config_text(state["config_text"], "running fleet").models)
        if model not in names:
            hint = did_you_mean(model, names)
            _fail(FleetError(f"no model '{model}' in the running fleet;{hint} its models: {', '.join(names)}"))
    from gpubroker.deployments.app import model_app_name  # noqa: PLC0415 - imports ray

    log_dir = serve_log_dir((state or {}).get("session_dir"))
    files = replica_logs(model_app_name(model, fleet_client.APP_NAME), model, log_dir)
    if not files:
        _fail(FleetError(f"no replica log of '{model}' under {log_dir} (replicas on other nodes log on theirs)"))
    for path in files:
        console.rule(str(path))
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        console.print("\n".join(text), highlight=False, markup=False)


# =============================================================================== apply, down
def apply(
    config: Path = typer.Argument(..., help="New fleet config YAML."),
    address: str = typer.Option(None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Validate locally, then swap the running broker's config; exit 1 with the issues if refused."""
    try:
        text = config.read_text(encoding="utf-8")
        parse_config_text(text, str(config), units_required=True)  # as `up` reads a file: sizes with units
    except ConfigError as exc:
        print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        _fail(FleetError(f"cannot read {config}: {exc}"))
    try:
        result = fleet_client.apply_config(address, text, str(config))
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
    if not result["ok"]:
        raise typer.Exit(1)


def _say(line: str, note: Note) -> None:
    console.print(line if note is Note.DONE else f"[yellow]{line}[/]")


def down(
    address: str | None = typer.Option(
        None, "--address", help="Ray cluster (default: the one `up` started, or RAY_ADDRESS)."
    ),
) -> None:
    """Shut Serve down, kill the broker, and stop the local Ray that `up` started."""
    try:
        fleet.down_fleet(address, _say)
    except FleetError as exc:
        _fail(exc)
    console.print("[green]fleet down[/]")
