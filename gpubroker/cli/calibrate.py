"""``gpubroker calibrate CONFIG MODEL``: measure a model's profile on this machine and write it.

The model is built with its options and run in this process (no Ray): its memory model
(weights + bytes per item) by ``gpubroker.deployments.replica.calibration.calibrate``, the replica's own start-up
calibration, and its latency L(b) = a + c*b by timing batches of its example input (median of
a few runs per size, a least-squares line through them). The result goes under the model's
``profile:`` key, which ``simulate`` emulates and the quota suggestion below starts from: into
a copy of the config (``CONFIG.calibrated.yaml``), or into CONFIG itself with ``--write``; the
rest of the file, comments included, is kept as written.

With it comes a suggested ``quota`` for the model's SLO (``gpubroker.sizing.suggest_quota``): the
model's bytes at the batch floor, at the SLO's batch and alone, beside what the replica process
holds itself on host memory (its footprint, measured here as the replica measures it, and Ray
Serve's runtime), with the share of the grant a replica keeps free. It prints each part.
"""

from __future__ import annotations

import gc
import json
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import typer

from gpubroker.cli.views import print_config_error
from gpubroker.quotas.config import ConfigError, ModelSpec, load_config, parse_config_text
from gpubroker.quotas.sizes import exact_size, format_size, parse_size
from gpubroker.sizing import Footprint, QuotaSuggestion, kept_free_frac, runtime_bytes_for, suggest_quota


@dataclass(frozen=True)
class Measured:
    """What calibrate measured: the profile figures and the points behind them."""

    a_ms: float  # fixed cost of a batch
    c_ms: float  # cost per batch unit
    weights_bytes: int
    bytes_per_item: int  # per batch unit, rounded up
    unit: str  # requests or tokens
    memory_method: str  # gpubroker.deployments.replica.calibration's method: hooks, cuda, probe, declared, none
    process_bytes: int  # resident growth over loading and running the model, beyond its weights (0 on cuda)
    latency_points: tuple[tuple[float, float], ...]  # (batch cost, median ms)
    memory_points: tuple[tuple[float, float], ...]  # (batch cost, bytes)


def measure(spec: ModelSpec, sizes: tuple[int, ...], repeats: int, device: str) -> Measured:
    """Build the model with its options, load it on ``device`` and measure memory and latency;
    on host memory also the process's growth from before the model loads to after its runs."""
    from gpubroker.deployments.cluster.user_code import on_sys_path  # noqa: PLC0415
    from gpubroker.deployments.models import resolve_model  # noqa: PLC0415
    from gpubroker.deployments.replica.calibration import calibrate as memory_fit  # noqa: PLC0415 - torch behind it
    from gpubroker.deployments.replica.calibration import fit_line  # noqa: PLC0415

    on_sys_path()
    before = resident_before_model()
    adapter = resolve_model(spec.model)(**spec.options)
    adapter.load(device)
    memory = memory_fit(adapter, costs=sizes, device=device)
    try:
        example = adapter.validate(adapter.example_input())
    except NotImplementedError as exc:
        raise ValueError(
            f"model {spec.model} has no example_input(); calibrate runs the model on it: add example_input() "
            "returning one valid input"
        ) from exc
    batches = [[example] * size for size in sizes]
    for batch in batches:
        adapter.predict(batch)  # warm-up at each size (allocator, kernels)
    times: list[list[float]] = [[] for _ in batches]
    for _ in range(repeats):  # round-robin over the sizes: a busy moment hits them all alike
        for i, batch in enumerate(batches):
            started = time.perf_counter()
            adapter.predict(batch)
            times[i].append((time.perf_counter() - started) * 1000.0)
    points = [
        (float(sum(adapter.cost(item) for item in batch)), statistics.median(ms)) for batch, ms in zip(batches, times)
    ]
    a_ms, c_ms = fit_line(points)
    grown = 0 if device.startswith("cuda") else resident_bytes() - before
    return Measured(
        a_ms=round(a_ms, 3),
        c_ms=round(c_ms, 4),
        weights_bytes=int(memory.weights_bytes),
        bytes_per_item=int(math.ceil(memory.bytes_per_unit)),
        unit=memory.unit,
        memory_method=memory.method,
        process_bytes=max(0, grown - int(memory.weights_bytes)),
        latency_points=tuple((x, round(y, 3)) for x, y in points),
        memory_points=memory.points,
    )


def resident_before_model() -> int:
    """Resident bytes as a replica measures them before its model loads: torch imported (the
    replica imports it first: the runtime, not the model), garbage collected."""
    try:
        import torch  # noqa: F401, PLC0415
    except ImportError:
        pass
    return resident_bytes()


def resident_bytes() -> int:
    from gpubroker.deployments.enforce.probes import rss_bytes  # noqa: PLC0415

    gc.collect()
    return rss_bytes() or 0


def size_text(n: int) -> str:
    """A size for the config: the human form when exact, else bytes under 1 MiB and KiB (rounded
    up, under 0.1% more) above."""
    text = format_size(n)
    if parse_size(text) == n:
        return text
    return f"{n}B" if n < 1024**2 else f"{math.ceil(n / 1024)}KiB"


def profile_line(m: Measured) -> str:
    return (
        f"profile: {{a_ms: {m.a_ms:g}, c_ms: {m.c_ms:g}, weights_bytes: {size_text(m.weights_bytes)}, "
        f"bytes_per_item: {size_text(m.bytes_per_item)}, unit: {m.unit}}}"
    )


def with_profile(text: str, model: str, line: str) -> str:
    """``text`` with the model's ``profile:`` entry replaced by (or, if none, added as) ``line``,
    everything else as written. Raises ValueError when the model's block is not found."""
    lines = text.splitlines(keepends=True)
    head = next((i for i, t in enumerate(lines) if re.match(rf"^(\s+){re.escape(model)}:\s*(#.*)?$", t)), None)
    if head is None:
        raise ValueError(f"no block 'models.{model}:' found to write into (flow style?); add the line by hand")
    indent = len(lines[head]) - len(lines[head].lstrip())
    end = head + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
        end += 1
    body = lines[head + 1 : end]
    child = min((_indent(t) for t in body if t.strip() and not t.lstrip().startswith("#")), default=indent + 2)
    keep: list[str] = []
    skipping = False
    for t in body:
        if _indent(t) == child and t.strip():
            skipping = t.lstrip().startswith("profile:")
        if not skipping:
            keep.append(t)
    new = " " * child + line + "\n"
    return "".join(lines[: head + 1] + [new] + keep + lines[end:])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def calibrate(
    config: Path = typer.Argument(..., metavar="CONFIG", help="Fleet config YAML holding the model."),
    model: str = typer.Argument(..., metavar="MODEL", help="Name of the model under models:."),
    write: bool = typer.Option(False, "--write", help="Write the profile into CONFIG itself (default: a copy)."),
    out: Path = typer.Option(None, "--out", help="Where the copy goes (default CONFIG's name + .calibrated.yaml)."),
    slo_ms: float = typer.Option(None, "--slo-ms", help="P95 cap for the quota suggestion (default: slo_p95_ms)."),
    sizes: str = typer.Option("1,2,4,8,16", "--sizes", help="Batch sizes to time and measure, comma-separated."),
    repeats: int = typer.Option(5, "--repeats", min=1, max=100, help="Timed runs per batch size (median)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda:N."),
    runtime: str = typer.Option(
        None,
        "--runtime",
        help="Memory Ray Serve's replica runtime holds beside the model, e.g. 64MiB "
        "(default: 48MiB on cpu, 0 on cuda; gpubroker status shows a live replica's used bytes).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the measurement as JSON."),
) -> None:
    """Measure a model's latency and memory profile here and write it under its profile: key."""
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        print_config_error(exc)
        raise typer.Exit(exc.exit_code) from None
    spec = cfg.models.get(model)
    if spec is None or spec.kind != "batch":
        why = "is an LLM engine (kind: llm); calibrate measures batch models" if spec else "is not in it"
        _fail(f"{config}: model '{model}' {why}; models: {', '.join(cfg.models)}")
    try:
        batch_sizes = tuple(int(s) for s in sizes.split(",") if s.strip())
        if len(batch_sizes) < 2 or min(batch_sizes) < 1:
            raise ValueError
    except ValueError:
        _fail(f"--sizes {sizes!r}: give at least two batch sizes >= 1, e.g. 1,2,4,8,16")
    try:
        runtime_bytes = runtime_bytes_for(device) if runtime is None else parse_size(runtime)
    except ValueError as exc:
        _fail(f"--runtime {runtime!r}: {exc}; give a size such as 64MiB")
    measured = measure(spec, batch_sizes, repeats, device)
    footprint = Footprint(measured.process_bytes, runtime_bytes)
    quota = suggest_quota(
        measured.a_ms,
        measured.c_ms,
        measured.weights_bytes,
        measured.bytes_per_item,
        spec,
        slo_ms,
        footprint,
        kept_free_frac(cfg),
    )
    target = config if write else (out or config.with_name(config.stem + ".calibrated.yaml"))
    text = with_profile(config.read_text(encoding="utf-8"), model, profile_line(measured))
    try:
        parse_config_text(text, str(target), units_required=True)
    except ConfigError as exc:  # e.g. a profiled model whose options say otherwise
        print_config_error(exc)
        raise typer.Exit(1) from None
    target.write_text(text, encoding="utf-8")
    if as_json:
        print(json.dumps({"model": model, "measured": asdict(measured), "quota": asdict(quota), "wrote": str(target)}))
        return
    _report(model, measured, quota, target)


def _report(model: str, m: Measured, q: QuotaSuggestion, target: Path) -> None:
    print(f"{model}: L(b) = {m.a_ms:g} ms + {m.c_ms:g} ms x b ({m.unit}); points (cost, ms): {list(m.latency_points)}")
    print(
        f"{model}: memory = {exact_size(m.weights_bytes)} + {exact_size(m.bytes_per_item)} per "
        f"{m.unit[:-1]} (method {m.memory_method})"
    )
    print(
        f"{model}: beside it the replica process holds {format_size(q.process_bytes)} (measured here: loading and "
        f"running it, beyond its weights) + {format_size(q.runtime_bytes)} (Ray Serve's replica runtime, --runtime)"
    )
    print(f"wrote {target}: models.{model}.{profile_line(m)}")
    print(
        f"suggested for P95 <= {q.slo_p95_ms:g} ms (batch {q.batch_at_slo} at load, {q.batch_alone} alone): "
        f"quota: {{min: {size_text(q.min_bytes)}, base: {size_text(q.base_bytes)}, max: {size_text(q.max_bytes)}}}"
    )
    print(f"  each = {quota_formula(q)}, rounded up to MiB")


def quota_formula(q: QuotaSuggestion) -> str:
    """The suggestion's arithmetic in words: its parts and the share kept free."""
    return (
        f"({format_size(q.process_bytes)} process + {format_size(q.runtime_bytes)} runtime + "
        f"{format_size(q.weights_bytes)} weights + {format_size(math.ceil(q.bytes_per_item))} x batch) / "
        f"(1 - {q.free_frac:g} kept free)"
    )


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)
