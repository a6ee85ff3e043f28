"""The demo fleet without a clone: ``--demo`` for ``up`` and ``validate``, and ``gpubroker demo-config``.

The files are the package's own (``gpubroker.demo``); this module picks the config a command reads
and writes the files out for a user who wants to read or edit them.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from gpubroker.cli.views import err_console
from gpubroker.demo import FILES, demo_path, write_demo_files

console = Console()
DEMO_HELP = "The demo fleet shipped in the package (configs/demo.yaml of a clone); no CONFIG needed."


def config_or_demo(config: Path | None, demo: bool, *, default_demo: bool) -> Path:
    """The config file a command reads: CONFIG, or the shipped demo with ``--demo`` (or with neither, where
    ``default_demo``). Both, or neither where a CONFIG is required, is a usage error (exit 2) saying so."""
    if config is not None and demo:
        raise typer.BadParameter(f"give CONFIG ({config}) or --demo, not both", param_hint="CONFIG")
    if config is not None:
        return config
    if demo or default_demo:
        return demo_path()
    raise typer.BadParameter("give a fleet config file, or --demo for the demo fleet", param_hint="CONFIG")


def demo_config(
    out: Path = typer.Option(Path("configs"), "--out", help="Folder to write into (made if missing)."),
    force: bool = typer.Option(False, "--force", help="Replace files already there."),
) -> None:
    """Write the demo fleets' files (the fleet configs, Prometheus's and Grafana's) under --out.

    Then the commands the README shows work as written outside a clone: `gpubroker up
    configs/demo.yaml`, `gpubroker validate configs/cluster-demo.yaml`, `prometheus
    --config.file=configs/prometheus.yml`."""
    try:
        written = write_demo_files(out, force=force)
    except FileExistsError as exc:
        err_console.print(f"[bold red]error[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    console.print(
        f"{len(FILES)} file(s); start the demo fleet with `gpubroker up {out / 'demo.yaml'}`", highlight=False
    )
