"""``gpubroker`` command line (Typer + rich): the top of the import graph.

Every command is imported here statically; each lives in the module of what it drives
(``gpubroker.cli.fleet``, ``gpubroker.cli.simulate``, ``gpubroker.cli.calibrate``); the benchmarks
are ``python -m bench`` from a clone (bench/ is not installed, so no installed command runs it). Heavy imports (ray, torch) stay inside the command bodies so
``gpubroker validate --no-import`` answers in well under a second. Habits of other CLIs hold:
``-h``, ``--version``, shell completion, flags without values, the config file as an argument.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from gpubroker import __version__
from gpubroker.cli import calibrate, demo, fleet, simulate
from gpubroker.cli.views import budget_table, config_table, placement_table, print_config_error
from gpubroker.quotas.config import ConfigError, FleetConfig, load_config
from gpubroker.quotas.config_errors import MISSING, ConfigIssue
from gpubroker.quotas.placement import Placement, place_fleet
from gpubroker.sizing import quota_warnings
from gpubroker.validate import budget, build_models, check_llms

app = typer.Typer(
    name="gpubroker",
    help="Share one GPU between several Ray Serve models: quota lending and load-following batching.",
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,  # click's plain help: a flag shows no value (Typer's rich help shows <bool>)
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()


def _version(value: bool) -> None:
    if value:
        print(f"gpubroker {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Share one GPU between several Ray Serve models."""


def _deep_issues(cfg: FleetConfig, no_import: bool, timeout_s: float) -> tuple[list[ConfigIssue], list[str], str]:
    """What the schema cannot see: the project shadowing our packages, each model built in a child,
    each LLM's model on disk and its engine_kwargs against vLLM (and how they were checked)."""
    from gpubroker.deployments.cluster.user_code import check_project  # noqa: PLC0415 - reads the file tree only

    project = check_project((n, s.model) for n, s in cfg.models.items() if s.kind == "batch")
    issues = [ConfigIssue("models", MISSING, message) for message in project.errors]
    if not no_import and not project.errors:
        issues += build_models(cfg, timeout_s=timeout_s)
    llms = check_llms(cfg, with_vllm=not no_import, timeout_s=max(timeout_s, 120.0))
    return issues + llms.issues, list(project.warnings) + llms.warnings + quota_warnings(cfg), llms.checked


@app.command()
def validate(
    config: Path | None = typer.Argument(None, metavar="CONFIG", help="Fleet config YAML to check."),
    demo_fleet: bool = typer.Option(False, "--demo", help=demo.DEMO_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON result instead of a table."),
    explain: bool = typer.Option(
        False,
        "--explain",
        help="Show the card's budget: capacity, reserve, per-process CUDA context, usable, each model's "
        "min/base/max, in bytes.",
    ),
    no_import: bool = typer.Option(
        False, "--no-import", help="Do not import and build each model class (checks the file alone)."
    ),
    import_timeout_s: float = typer.Option(
        60.0, "--import-timeout", min=1, help="Seconds the import-and-build check may take, all models together."
    ),
) -> None:
    """Check a fleet config: exit 0 valid, 1 invalid (every problem listed), 2 unreadable or not YAML.

    Beyond the file, each model class is imported and built with its options in a child process
    (no Ray), from the current directory as `gpubroker up` runs it."""
    config = demo.config_or_demo(config, demo_fleet, default_demo=False)
    try:
        cfg = load_config(config)
        issues, warnings, llm_checked = _deep_issues(cfg, no_import, import_timeout_s)
        if issues:
            raise ConfigError(issues, str(config))
    except ConfigError as exc:
        if as_json:
            doc = {"valid": False, "source": exc.source, "issues": [_issue_json(i) for i in exc.issues]}
            print(json.dumps(doc, indent=2))
        else:
            print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    placement = place_fleet(cfg) if isinstance(cfg.gpus, list) else None  # gpus: auto is placed at start
    if as_json:
        print(json.dumps(_valid_json(cfg, config, placement, explain, warnings), indent=2))
        return
    for warning in warnings:
        console.print(f"[yellow]warning[/] {warning}", highlight=False)
    console.print(config_table(cfg, str(config)))
    if placement is not None:
        console.print(placement_table(placement))
    if explain and cfg.gpus is None:
        console.print(budget_table(budget(cfg)))
    profiles = ", ".join(
        f"{p.name}{' (default)' if p.default else f' {p.days} {p.hours}'}: {p.objective}, ${p.price_per_gpu_hour:g}/h"
        for p in cfg.profiles.schedule
    )
    console.print(f"profiles ({cfg.profiles.timezone}): {profiles}")
    batch = sum(1 for m in cfg.models.values() if m.kind == "batch")
    llms = len(cfg.models) - batch
    checked = "file only (--no-import)" if no_import else f"{batch} model class(es) imported and built"
    if llms:
        checked += f"; {llms} LLM engine(s): models found on disk, {llm_checked}"
    console.print(f"[green]valid[/] - config hash {cfg.config_hash()} ({checked})")


def _issue_json(issue: ConfigIssue) -> dict[str, str]:
    return {"path": issue.path, "message": issue.message, "text": str(issue)}


def _valid_json(
    cfg: FleetConfig, config: Path, placement: Placement | None, explain: bool, warnings: list[str]
) -> dict[str, Any]:
    doc = {
        "valid": True,
        "source": str(config),
        "config_hash": cfg.config_hash(),
        "config": cfg.model_dump(mode="json"),
        "warnings": warnings,
    }
    if placement is not None:
        doc["placement"] = placement.to_dict()
    if explain and cfg.gpus is None:
        doc["budget"] = budget(cfg).to_dict()
    return doc


# In the order `gpubroker --help` lists them.
app.command(name="simulate")(simulate.simulate)
app.command(name="calibrate")(calibrate.calibrate)
app.command(name="up")(fleet.up)
app.command(name="status")(fleet.status)
app.command(name="apply")(fleet.apply)
app.command(name="decisions")(fleet.decisions)
app.command(name="logs")(fleet.logs)
app.command(name="down")(fleet.down)
app.command(name="demo-config")(demo.demo_config)
