"""``gpubroker simulate``: run the discrete-event simulator on a fleet config.

Heavy imports (the simulator, numpy) stay inside the command so the CLI starts fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from gpubroker.cli.views import knee_check_table, print_config_error, result_table
from gpubroker.quotas.config import FleetConfig

if TYPE_CHECKING:
    from rich.console import Console

    from gpubroker.sim.knee import RunSettings
    from gpubroker.sim.types import Arm


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
    args = SimulateArgs(
        config=config,
        card=card,
        policy=policy,
        rate=rate,
        sweep=sweep,
        seed=seed,
        duration_s=duration_s,
        arrivals=arrivals,
        split=split,
        warmup_s=warmup_s,
        knee_check=knee_check,
        no_oracle=no_oracle,
        as_json=as_json,
        series=series,
        batching=batching,
    )
    cfg = _load_fleet(args)
    arm = _checked_arm(args)
    if args.knee_check:
        _run_knee_check(cfg, args)
    elif args.sweep:
        _run_sweep(cfg, arm, args)
    else:
        _run_once(cfg, arm, args)


@dataclass(frozen=True)
class SimulateArgs:
    """The options of one ``gpubroker simulate`` run, as the command line gave them."""

    config: Path
    card: str | None
    policy: str
    rate: float | None
    sweep: bool
    seed: int
    duration_s: float
    arrivals: str
    split: str
    warmup_s: float
    knee_check: bool
    no_oracle: bool
    as_json: bool
    series: bool
    batching: str

    def search_settings(self, split: str = "even") -> RunSettings:
        """How each rate of a knee search runs: the warm-up defaults to a quarter of the run, at most 30 s."""
        from gpubroker.sim.knee import RunSettings  # noqa: PLC0415

        return RunSettings(
            duration_s=self.duration_s,
            warmup_s=self.warmup_s or min(30.0, self.duration_s / 4),
            seed=self.seed,
            arrivals=self.arrivals,
            split=split,
            batching=self.batching,
        )


def _console() -> Console:
    from rich.console import Console  # noqa: PLC0415

    console = Console(emoji=False)
    return console if console.is_terminal else Console(emoji=False, width=160)


def _load_fleet(a: SimulateArgs) -> FleetConfig:
    """The config to simulate: one card of it where it lists cards; its capacity must be explicit."""
    from gpubroker.quotas.config import ConfigError, load_config  # noqa: PLC0415

    try:
        cfg = load_config(a.config)
    except ConfigError as exc:
        print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    if a.card is not None or cfg.gpus is not None:
        cfg = _one_card(cfg, a)
    if cfg.gpu.capacity_bytes is None:
        _fail(
            f"{a.config}: gpu.capacity is 'auto', but the simulator has no card to measure; "
            "set gpu.capacity to an explicit size (e.g. capacity: 24GiB) in the config",
            1,
        )
    return cfg


def _one_card(cfg: FleetConfig, a: SimulateArgs) -> FleetConfig:
    """The models placement puts on ``--card`` as a one-card fleet (lending is per card)."""
    from gpubroker.quotas.card_fleet import card_fleet  # noqa: PLC0415

    if a.card is None:
        ids = ", ".join(c.id for c in cfg.gpus) if isinstance(cfg.gpus, list) else "a card id under gpus:"
        _fail(
            f"{a.config} lists cards (gpus:); the simulator runs one card (lending is per card): "
            f"add --card ID ({ids}) to simulate the models placed on it",
            1,
        )
    try:
        return card_fleet(cfg, a.card, str(a.config))
    except ValueError as exc:
        _fail(str(exc), 1)


def _checked_arm(a: SimulateArgs) -> Arm:
    """The arm --policy names, once every option is checked; a bad one exits 2 naming it and the fix."""
    from gpubroker.sim.types import parse_arm  # noqa: PLC0415
    from gpubroker.sim.workload import parse_arrivals  # noqa: PLC0415

    try:
        arm = parse_arm(a.policy)
        parse_arrivals(a.arrivals)
        if a.split not in ("even", "powerlaw"):
            raise ValueError(f"split '{a.split}' is not known; use even or powerlaw")
        if a.rate is not None and a.rate <= 0:
            raise ValueError(f"--rate ({a.rate}) must be > 0 requests per second")
        if a.duration_s <= 0:
            raise ValueError(f"--duration-s ({a.duration_s}) must be > 0")
        if a.batching not in ("eager", "lazy"):
            raise ValueError(f"--batching '{a.batching}' is not known; use eager (Ray 2.60) or lazy")
    except ValueError as exc:
        _fail(str(exc))
    return arm


def _run_knee_check(cfg: FleetConfig, a: SimulateArgs) -> None:
    """--knee-check: the knees of static 8, the broker and the oracle of a one-model profile."""
    from gpubroker.sim.knee import seed_validation  # noqa: PLC0415

    if len(cfg.models) != 1:
        _fail(
            f"--knee-check takes a one-model profile config; {a.config} has {len(cfg.models)} models "
            "(use configs/sim-a20-c0.5.yaml or configs/sim-a10-c2.yaml)"
        )
    console = _console()
    say = None if a.as_json else (lambda msg: console.print(msg, highlight=False))
    v = seed_validation(cfg, a.search_settings(), oracle_grid=not a.no_oracle, on_progress=say)
    if a.as_json:
        print(json.dumps(v, indent=2, default=str))
    else:
        console.print(knee_check_table(v))


def _run_sweep(cfg: FleetConfig, arm: Arm, a: SimulateArgs) -> None:
    """--sweep: the knee of one arm, every rate tried printed as it runs."""
    from gpubroker.sim.knee import knee  # noqa: PLC0415

    console = _console()
    printer = (
        None
        if a.as_json
        else (
            lambda row: console.print(
                f"rate {row['rate']:.1f}/s: {'pass' if row['pass'] else 'FAIL'} ({row['why']})", highlight=False
            )
        )
    )
    res = knee(cfg, arm, _total_rate(cfg, a), a.search_settings(a.split), on_row=printer)
    if a.as_json:
        print(json.dumps(res.to_dict(), indent=2))
    else:
        console.print(
            f"[bold]knee[/] of {arm.label}: {res.knee_rps:.1f} req/s "
            f"(attainment within cap {', '.join(f'{k} {v:g} ms' for k, v in res.cap_ms.items())} ≥ 0.99)"
        )


def _total_rate(cfg: FleetConfig, a: SimulateArgs) -> float:
    return a.rate if a.rate is not None else sum(default_rates(cfg).values())


def _run_once(cfg: FleetConfig, arm: Arm, a: SimulateArgs) -> None:
    """One run at --rate (split over the models) or at each model's reference rate."""
    from gpubroker.sim.engine import SimOptions, run_sim  # noqa: PLC0415
    from gpubroker.sim.knee import rates_for  # noqa: PLC0415

    rates = rates_for(cfg, a.rate, a.split) if a.rate is not None else default_rates(cfg)
    opts = SimOptions(seed=a.seed, warmup_s=a.warmup_s, batching=a.batching)
    result = run_sim(cfg, arm, rates, a.duration_s, arrivals=a.arrivals, opts=opts)
    if a.as_json:
        print(json.dumps(result.to_dict(series=a.series), indent=2))
        return
    card = f" card {a.card}" if a.card else ""
    _console().print(
        result_table(
            result,
            f"{a.config}{card}: {arm.label}, {a.arrivals}, {_total_rate(cfg, a):.1f} req/s total, "
            f"{a.duration_s:g} s simulated in {result.wall_s:.2f} s",
        )
    )
