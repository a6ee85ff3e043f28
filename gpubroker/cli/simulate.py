"""``gpubroker simulate``: run the discrete-event simulator on a fleet config.

Heavy imports (the simulator, numpy) stay inside the command so the CLI starts fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

from gpubroker.cli.views import knee_check_table, print_config_error, result_table
from quotas.config import FleetConfig


def default_rates(config: FleetConfig) -> dict[str, float]:
    """Without --rate: each model at its reference rate (half of static 8's saturation)
    divided by the number of models sharing the card."""
    from gpubroker.sim.knee import reference_rate  # noqa: PLC0415
    from gpubroker.sim.profile import profile_for  # noqa: PLC0415

    n = len(config.models)
    return {name: reference_rate(profile_for(name, spec)) / n for name, spec in config.models.items()}


def _fail(message: str, code: int = 2) -> NoReturn:
    from rich.console import Console  # noqa: PLC0415

    Console(stderr=True, emoji=False).print(f"[bold red]error[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


def simulate(
    config: Path = typer.Argument(
        ...,
        metavar="CONFIG",
        help="Fleet config YAML (gpu.capacity an explicit size, or listed gpus: with --card).",
    ),
    card: str | None = typer.Option(
        None,
        "--card",
        help="With a listed gpus: fleet: simulate one card, the models placement puts on it (lending is per card).",
    ),
    policy: str = typer.Option(
        "broker", "--policy", help="broker, or static:<batch>[:<wait_ms>] (e.g. static:8, static:32:5)."
    ),
    rate: float | None = typer.Option(
        None,
        "--rate",
        help="Total offered rate, req/s, split over the models (default: each model's reference rate / n).",
    ),
    sweep: bool = typer.Option(
        False, "--sweep", help="Find the knee: step the rate ~10% then bisect; prints every rate tried."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrivals (the same for every arm)."),
    duration_s: float = typer.Option(120.0, "--duration-s", help="Seconds of arrivals (simulated)."),
    arrivals: str = typer.Option(
        "poisson", "--arrivals", help="poisson, gamma:CV (e.g. gamma:2) or trace (Azure LLM 2023)."
    ),
    split: str = typer.Option("even", "--split", help="How --rate is split over models: even or powerlaw."),
    warmup_s: float = typer.Option(
        0.0, "--warmup-s", help="Seconds at the start left out of the metrics (--sweep/--knee-check default 30)."
    ),
    knee_check: bool = typer.Option(
        False,
        "--knee-check",
        help="Benchmark a one-model profile: the knees of static 8 at S, the broker at 1.2·S and the oracle, "
        "against the bound (BENCHMARK.md's headline figures).",
    ),
    no_oracle: bool = typer.Option(
        False, "--no-oracle", help="With --knee-check: skip the static-grid oracle (faster)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    series: bool = typer.Option(
        False, "--series", help="With --json: include the per-interval time series and decisions."
    ),
    batching: str = typer.Option(
        "eager",
        "--batching",
        help="How @serve.batch forms batches: eager (Ray 2.60, the default) or lazy (BENCHMARK.md's quick model).",
    ),
) -> None:
    """Run the real policy on a virtual clock against emulated models (deterministic, fast)."""
    from rich.console import Console  # noqa: PLC0415

    from gpubroker.sim.engine import SimOptions, parse_arm, run_sim  # noqa: PLC0415
    from gpubroker.sim.knee import RunSettings, knee, rates_for, seed_validation  # noqa: PLC0415
    from gpubroker.sim.workload import parse_arrivals  # noqa: PLC0415
    from quotas.config import ConfigError, load_config  # noqa: PLC0415

    console = Console(emoji=False)
    if not console.is_terminal:
        console = Console(emoji=False, width=160)
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    if card is not None or cfg.gpus is not None:
        from quotas.card_fleet import card_fleet  # noqa: PLC0415

        if card is None:
            ids = ", ".join(c.id for c in cfg.gpus) if isinstance(cfg.gpus, list) else "a card id under gpus:"
            _fail(
                f"{config} lists cards (gpus:); the simulator runs one card (lending is per card): "
                f"add --card ID ({ids}) to simulate the models placed on it",
                1,
            )
        try:
            cfg = card_fleet(cfg, card, str(config))
        except ValueError as exc:
            _fail(str(exc), 1)
    if cfg.gpu.capacity_bytes is None:
        _fail(
            f"{config}: gpu.capacity is 'auto', but the simulator has no card to measure; "
            "set gpu.capacity to an explicit size (e.g. capacity: 24GiB) in the config",
            1,
        )
    try:
        arm = parse_arm(policy)
        parse_arrivals(arrivals)
        if split not in ("even", "powerlaw"):
            raise ValueError(f"split '{split}' is not known; use even or powerlaw")
        if rate is not None and rate <= 0:
            raise ValueError(f"--rate ({rate}) must be > 0 requests per second")
        if duration_s <= 0:
            raise ValueError(f"--duration-s ({duration_s}) must be > 0")
        if batching not in ("eager", "lazy"):
            raise ValueError(f"--batching '{batching}' is not known; use eager (Ray 2.60) or lazy")
    except ValueError as exc:
        _fail(str(exc))

    if knee_check:
        if len(cfg.models) != 1:
            _fail(
                f"--knee-check takes a one-model profile config; {config} has {len(cfg.models)} models "
                "(use configs/sim-a20-c0.5.yaml or configs/sim-a10-c2.yaml)"
            )
        rs = RunSettings(
            duration_s=duration_s,
            warmup_s=warmup_s or min(30.0, duration_s / 4),
            seed=seed,
            arrivals=arrivals,
            batching=batching,
        )
        say = None if as_json else (lambda msg: console.print(msg, highlight=False))
        v = seed_validation(cfg, rs, oracle_grid=not no_oracle, on_progress=say)
        if as_json:
            print(json.dumps(v, indent=2, default=str))
        else:
            console.print(knee_check_table(v))
        return

    total = rate if rate is not None else sum(default_rates(cfg).values())
    if sweep:
        rs = RunSettings(
            duration_s=duration_s,
            warmup_s=warmup_s or min(30.0, duration_s / 4),
            seed=seed,
            arrivals=arrivals,
            split=split,
            batching=batching,
        )
        printer = (
            None
            if as_json
            else (
                lambda row: console.print(
                    f"rate {row['rate']:.1f}/s: {'pass' if row['pass'] else 'FAIL'} ({row['why']})", highlight=False
                )
            )
        )
        res = knee(cfg, arm, total, rs, on_row=printer)
        if as_json:
            print(json.dumps(res.to_dict(), indent=2))
        else:
            console.print(
                f"[bold]knee[/] of {arm.label}: {res.knee_rps:.1f} req/s "
                f"(attainment within cap {', '.join(f'{k} {v:g} ms' for k, v in res.cap_ms.items())} ≥ 0.99)"
            )
        return

    rates = rates_for(cfg, total, split) if rate is not None else default_rates(cfg)
    result = run_sim(
        cfg, arm, rates, duration_s, arrivals=arrivals, opts=SimOptions(seed=seed, warmup_s=warmup_s, batching=batching)
    )
    if as_json:
        print(json.dumps(result.to_dict(series=series), indent=2))
        return
    console.print(
        result_table(
            result,
            f"{config}{f' card {card}' if card else ''}: {arm.label}, {arrivals}, {total:.1f} req/s total, "
            f"{duration_s:g} s simulated in {result.wall_s:.2f} s",
        )
    )
