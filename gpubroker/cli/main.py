"""``gpubroker`` command line (Typer + rich): the top of the import graph.

Every command is imported here statically; each lives in the module of what it drives
(``gpubroker.cli.fleet``, ``gpubroker.cli.simulate``, ``gpubroker.cli.bench``). Heavy imports (ray, torch) stay inside the
command bodies so ``gpubroker validate`` answers in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from gpubroker.cli import bench, fleet, simulate
from gpubroker.cli.views import config_table, placement_table, print_config_error
from quotas.config import ConfigError, load_config
from quotas.placement import place_fleet

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
            print(
                json.dumps(
                    {
                        "valid": False,
                        "source": exc.source,
                        "issues": [{"path": i.path, "message": i.message, "text": str(i)} for i in exc.issues],
                    },
                    indent=2,
                )
            )
        else:
            print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    placement = place_fleet(cfg) if isinstance(cfg.gpus, list) else None  # gpus: auto is placed at start
    if as_json:
        doc = {
            "valid": True,
            "source": str(config),
            "config_hash": cfg.config_hash(),
            "config": cfg.model_dump(mode="json"),
        }
        if placement is not None:
            doc["placement"] = placement.to_dict()
        print(json.dumps(doc, indent=2))
        return
    console.print(config_table(cfg, str(config)))
    if placement is not None:
        console.print(placement_table(placement))
    profiles = ", ".join(
        f"{p.name}{' (default)' if p.default else f' {p.days} {p.hours}'}: {p.objective}, ${p.price_per_gpu_hour:g}/h"
        for p in cfg.profiles.schedule
    )
    console.print(f"profiles ({cfg.profiles.timezone}): {profiles}")
    console.print(f"[green]valid[/] - config hash {cfg.config_hash()}")


# In the order `gpubroker --help` lists them.
app.command(name="simulate")(simulate.simulate)
for _name, _command in (
    ("up", fleet.up),
    ("status", fleet.status),
    ("apply", fleet.apply),
    ("decisions", fleet.decisions),
    ("down", fleet.down),
):
    app.command(name=_name)(_command)
app.command(name="bench")(bench.bench)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
