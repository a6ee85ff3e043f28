"""``python -m bench SCENARIO``, from the root of a clone: the benchmarks (bench/ is not installed).

Live ones on Ray Serve (``bench.scenarios_live``), lending, scale and the load matrix on the
simulator, llm on vLLM engines as Ray actors, and report (bench/RESULTS.md and README's table from
the committed JSON). Heavy imports (ray, aiohttp, matplotlib) stay inside the functions.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import typer

SCENARIO_NAMES = ("seed", "oracle", "burst", "overhead", "trace", "oracle-knee")
DEFAULT_OUT = Path("bench/out")


def bench(
    scenario: str = typer.Argument(
        ...,
        help="seed | oracle | burst | overhead | trace | oracle-knee, report (bench/RESULTS.md and README.md's table "
        "from the JSON committed under bench/results/), lending "
        "(where memory binds: static split, broker with quotas fixed, broker lending; the simulator), matrix (the load "
        "matrix on the simulator: fleets x arrival processes x load levels on fresh seeds, the broker against the "
        "fixed batch, the per-cell oracle and itself with quotas fixed; with --live its live subset on Ray Serve), or scale "
        "(the control plane: tick time against models and cards, and the simulator's speed; no Ray), or llm "
        "(vLLM CPU engines, each a Ray actor of its own, no Serve: broker rules vs static max_num_seqs, lending "
        "between three LLMs)",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a markdown table."),
    out: Path = typer.Option(
        DEFAULT_OUT, "--out", help="Directory for SCENARIO.json, SCENARIO.md and PNG plots (not for report)."
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="Short runs, one seed, small grids (about 3 minutes; llm: one seed of each load, about 15).",
    ),
    time_scale: float = typer.Option(
        10.0,
        "--time-scale",
        help="Slow the profiled emulation by this factor (rates fall by it; ratios do not change).",
    ),
    seeds: int = typer.Option(3, "--seeds", min=1, max=5, help="Seeds per point (full runs; --quick uses 1)."),
    peer: bool | None = typer.Option(
        None,
        "--peer/--no-peer",
        help="seed: run the BentoML peer arm (default: on; off with --quick, which must fit 3 minutes).",
    ),
    arrivals: str = typer.Option(
        "poisson",
        "--arrivals",
        help="seed/oracle/oracle-knee/overhead arrivals: poisson, or gamma:CV (bursty; BENCHMARK.md uses CV 2 and 4).",
    ),
    models: str = typer.Option(
        "", "--models", help="seed only: comma list of profiled,minilm (default: both; --quick: profiled)."
    ),
    live: bool = typer.Option(
        False,
        "--live",
        help="matrix only: the live subset on Ray Serve (bench/matrix_live.py): one model under a varying load "
        "(broker, fixed batch, BentoML) and three models on one emulated card (broker, quotas fixed, fixed batch); "
        "three runs on fresh seeds, arm order rotated (--quick: one short run). JSON under "
        "bench/results/<date>-matrix-live/ (--quick: under --out).",
    ),
    direct: bool = typer.Option(
        False,
        "--direct",
        help="Ray with Serve's direct ingress (broker.direct_ingress): one-model fleets are loaded on their "
        "replica's own port, not through the proxy.",
    ),
) -> None:
    """Run one benchmark scenario (live ones on Ray Serve; lending and scale without Ray; llm on Ray actors) or report.

    The live scenarios start and tear down their own apps; report writes bench/RESULTS.md and the
    README's results table from the JSON committed under bench/results/ (bench.results)."""
    args = BenchArgs(scenario, out, quick, time_scale, seeds, peer, arrivals, models, direct, as_json, live)
    if not _run_offline(args):
        _run_live(args)


@dataclass(frozen=True)
class BenchArgs:
    """The options of one ``python -m bench`` run, as the command line gave them."""

    scenario: str
    out: Path
    quick: bool
    time_scale: float
    seeds: int
    peer: bool | None
    arrivals: str
    models: str
    direct: bool
    as_json: bool
    live: bool = False


def _run_offline(a: BenchArgs) -> bool:
    """The scenarios without Serve (scale, llm, lending) and the report; False for a live one."""
    if a.scenario == "scale":  # the broker core on a fake clock and the simulator: no Ray (bench/scale.py)
        from bench import scale

        res = scale.run(quick=a.quick, out=a.out, on_progress=lambda m: typer.echo(m, err=True))
        print(json.dumps(res) if a.as_json else scale.table(res))
        typer.echo(f"wrote {a.out / 'scale.json'}", err=True)
        return True
    # llm: vLLM engines as Ray actors, broker vs static bounds, lending between three (bench/llm_bench.py)
    if a.scenario == "llm":
        from bench import llm_bench

        res = llm_bench.run(quick=a.quick, out=a.out, log=lambda msg: typer.echo(msg, err=True))
        print(json.dumps(res, default=str) if a.as_json else llm_bench.table(res))
        typer.echo(f"wrote {a.out / 'llm.json'}", err=True)
        return True
    if a.scenario == "lending":  # where memory binds: static split vs broker with quotas fixed vs lending (simulator)
        from bench import lending

        # the independent load runs every seed, --quick too (its target must hold on each)
        res = lending.run(
            quick=a.quick, out=a.out, seeds=tuple(range(a.seeds)), on_progress=lambda m: typer.echo(m, err=True)
        )
        print(json.dumps(res, default=str) if a.as_json else lending.table(res))
        typer.echo(f"wrote {a.out / 'lending.json'} in {res['runtime_s']:.0f} s", err=True)
        return True
    if a.scenario == "matrix":  # the load matrix: on the simulator (bench/matrix.py), or its live subset (--live)
        if a.live:
            _run_matrix_live(a)
        else:
            _run_matrix(a)
        return True
    if a.scenario == "report":  # RESULTS.md and the README's table from the JSON committed under bench/results/
        from bench import results

        if a.out != DEFAULT_OUT:  # the report has one source, the committed JSON: a --out would be ignored
            typer.echo(
                f"python -m bench report: --out {a.out} is not read: the report reads the JSON committed under "
                f"{results.ROOT}/ (commit a run's JSON there to report it); drop --out",
                err=True,
            )
            raise typer.Exit(2)
        try:
            results.write()
        except (OSError, ValueError) as exc:
            typer.echo(f"python -m bench report: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"wrote bench/RESULTS.md and README.md's results table from {results.ROOT}/")
        return True
    return False


def _run_matrix(a: BenchArgs) -> None:
    """The load matrix: matrix.json (aggregates per cell, the seeds drawn now) and matrix.png under --out."""
    from bench import matrix
    from bench.sim_figures import code_version

    res = matrix.run(quick=a.quick, out=None, say=lambda m: typer.echo(m, err=True))
    res["command"] = "python -m bench matrix" + (" --quick" if a.quick else "") + f" --out {a.out}"
    res["code"] = code_version()  # the commit the run is on (and whether the tree was clean)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "matrix.json").write_text(matrix.dumps(res), encoding="utf-8")
    print(json.dumps(res) if a.as_json else matrix.table(res))
    png = matrix.heatmap(res, a.out / "matrix.png")
    if png is None:
        typer.echo("matrix.png skipped: matplotlib is not installed (pip install 'gpubroker[plot]')", err=True)
    typer.echo(f"wrote {a.out / 'matrix.json'} in {res['runtime_s']:.0f} s", err=True)


def _run_matrix_live(a: BenchArgs) -> None:
    """The live subset of the load matrix (Ray Serve): matrix-live.json, under
    bench/results/<date>-matrix-live/ for a full run with the default --out, else under --out."""
    from bench import matrix_live
    from bench.sim_figures import code_version

    code = code_version()  # the commit the run starts on
    res = matrix_live.run(quick=a.quick, time_scale=a.time_scale, say=lambda m: typer.echo(m, err=True))
    out = a.out
    if out == DEFAULT_OUT and not a.quick:
        out = Path("bench/results") / f"{time.strftime('%Y-%m-%d')}-matrix-live"
    res["command"] = "python -m bench " + " ".join(sys.argv[1:])
    res["code"] = code
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix-live.json").write_text(json.dumps(res, separators=(",", ":"), default=str), encoding="utf-8")
    print(json.dumps(res, default=str) if a.as_json else matrix_live.table(res))
    typer.echo(f"wrote {out / 'matrix-live.json'} in {res['runtime_s']:.0f} s", err=True)


def _run_live(a: BenchArgs) -> None:
    """A live scenario on Ray Serve: run it, then write SCENARIO.json, SCENARIO.md and plots under --out."""
    if a.scenario not in SCENARIO_NAMES:
        typer.echo(
            f"unknown scenario '{a.scenario}'; choose one of {', '.join(SCENARIO_NAMES)} (or report, scale, llm)",
            err=True,
        )
        raise typer.Exit(2) from None
    from bench.live_runs import parse_arrivals

    try:
        parse_arrivals(a.arrivals)
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    from bench import plots
    from bench import scenarios_live as live
    from bench.scenarios_report import MD
    from bench.sim_figures import code_version

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    o = live.Opts.make(
        a.quick,
        time_scale=a.time_scale,
        peer=(not a.quick) if a.peer is None else a.peer,
        log=log,
        seed_json=str(a.out / "seed.json"),
        arrivals=a.arrivals,
        direct=a.direct,
    )
    if not a.quick:
        o.seeds = tuple(range(a.seeds))
    t0, code = time.time(), code_version()  # the commit the run starts on (bench report names it)
    if a.scenario == "seed" and a.models:
        res = live.seed(o, tuple(m.strip() for m in a.models.split(",") if m.strip()))
    else:
        res = live.SCENARIOS[a.scenario](o)
    res["runtime_s"] = round(time.time() - t0, 1)
    res["command"] = "python -m bench " + " ".join(sys.argv[1:])
    res["code"] = code
    res["quick"] = a.quick
    res["arrivals"] = a.arrivals
    res["direct_ingress"] = a.direct
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.scenario}.json").write_text(json.dumps(res, indent=1, default=str), encoding="utf-8")
    md = MD[a.scenario](res) + f"\n\nRuntime {res['runtime_s']:.0f} s{' (--quick)' if a.quick else ''}.\n"
    (a.out / f"{a.scenario}.md").write_text(md, encoding="utf-8")
    pngs = plots.plot(a.scenario, res, a.out)
    if a.as_json:
        print(json.dumps(res, default=str))
    else:
        print(md)
        for p in pngs:
            print(f"plot: {p}")


app = typer.Typer(
    name="python -m bench",
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command()(bench)  # one command: the scenario is its first argument


def main() -> None:
    """``python -m bench``."""
    app(prog_name="python -m bench")
