"""`gpubroker` command line (Typer + rich).

Commands live next to what they drive and are registered here; heavy imports (ray, torch)
stay inside the command bodies so `gpubroker validate` answers in well under a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from quotas.config import ConfigError, FleetConfig, load_config
from quotas.sizes import format_size

app = typer.Typer(
    name="gpubroker",
    help="Share one GPU between several Ray Serve models: quota lending and load-following batching.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


@app.callback()
def _root() -> None:
    """Share one GPU between several Ray Serve models."""

err_console = Console(stderr=True)


def print_config_error(exc: ConfigError) -> None:
    err_console.print(f"[bold red]invalid config[/] {exc.source}: {len(exc.issues)} problem(s)")
    for issue in exc.issues:
        err_console.print(f"  - {issue}", markup=False, highlight=False)


def config_table(cfg: FleetConfig, source: str) -> Table:
    cap = cfg.gpu.capacity_bytes
    usable = format_size(cfg.usable_bytes()) if cap is not None else "auto (measured at start)"
    table = Table(title=f"{source}: {len(cfg.models)} model(s), device {cfg.gpu.device}, usable {usable}")
    for col in ("model", "ref", "quota min/base/max", "batch", "wait ms", "P95 SLO ms", "prio", "replicas", "strategy"):
        table.add_column(col)
    for name, m in cfg.models.items():
        table.add_row(
            name,
            m.model,
            f"{format_size(m.quota.min)} / {format_size(m.quota.base)} / {format_size(m.quota.max)}",
            f"{m.batch.floor}..{m.batch.ceiling} {m.batch.unit}",
            f"{m.wait.min_ms:g}..{m.wait.max_ms:g}",
            f"{m.slo_p95_ms:g}",
            str(m.priority),
            str(m.replicas),
            m.control.strategy,
        )
    return table


@app.command()
def validate(
    config: Path = typer.Argument(..., help="Fleet config YAML to check."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON result instead of a table."),
) -> None:
    """Check a fleet config: exit 0 valid, 1 invalid (every problem listed), 2 unreadable or not YAML."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        if as_json:
            print(json.dumps({"valid": False, "source": exc.source, "issues": [
                {"path": i.path, "message": i.message, "text": str(i)} for i in exc.issues]}, indent=2))
        else:
            print_config_error(exc)
        raise typer.Exit(exc.exit_code)
    if as_json:
        print(json.dumps({"valid": True, "source": str(config), "config_hash": cfg.config_hash(),
                          "config": cfg.model_dump(mode="json")}, indent=2))
        return
    console.print(config_table(cfg, str(config)))
    profiles = ", ".join(
        f"{p.name}{' (default)' if p.default else f' {p.days} {p.hours}'}: {p.objective}, ${p.price_per_gpu_hour:g}/h"
        for p in cfg.profiles.schedule
    )
    console.print(f"profiles ({cfg.profiles.timezone}): {profiles}")
    console.print(f"[green]valid[/] - config hash {cfg.config_hash()}")


def _register_optional() -> None:
    """Commands whose modules may be absent in a partial checkout are registered if present."""
    import importlib

    for module, names in (
        ("bench.cli_simulate", ("simulate",)),
        ("deployments.cli_fleet", ("up", "status", "apply", "decisions", "down")),
        ("bench.cli_bench", ("bench",)),
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        for name in names:
            fn = getattr(mod, name, None)
            if fn is not None:
                app.command(name=name)(fn)


_register_optional()


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
