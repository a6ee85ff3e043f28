"""PNG plots of the live benchmarks (matplotlib, the ``plot`` extra; Agg backend, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def knee_curves(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """seed: attainment vs rate and P95 vs rate, one line per arm, per workload."""
    plt = _plt()
    paths = []
    for i, r in enumerate(res.get("results", [])):
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for arm in ("static8", "static8 saturation (loose cap)", "broker", "bentoml"):
            rows = (
                (r.get("saturation_rows") or [])
                if arm.startswith("static8 sat")
                else ((r.get(arm) or {}).get("rows") or [])
            )
            pts = sorted((row["rate"], next(iter(row["models"].values()))) for row in rows)
            if not pts:
                continue
            ax1.plot([p[0] for p in pts], [p[1]["attainment"] for p in pts], "o-", label=arm)
            ax2.plot([p[0] for p in pts], [p[1]["p95_ms"] or float("nan") for p in pts], "o-", label=arm)
        if r.get("static8_saturation_rps"):
            for ax in (ax1, ax2):
                ax.axvline(r["static8_saturation_rps"], color="tab:blue", ls=":", lw=1)
            ax1.text(
                r["static8_saturation_rps"],
                0.05,
                " static 8:10 measured saturation",
                color="tab:blue",
                fontsize=7,
                transform=ax1.get_xaxis_transform(),
            )
        if r.get("bound_rps"):
            ax1.axvline(r["bound_rps"], color="k", ls="-.", lw=1)
            ax1.text(
                r["bound_rps"], 0.15, " bound (1−2a/C)/c", fontsize=7, ha="right", transform=ax1.get_xaxis_transform()
            )
        ax2.axhline(r["S_ms"], color="grey", ls=":", label="S (static 8 cap)")
        ax2.axhline(r["cap_ms"], color="k", ls="--", label="1.2·S (broker cap)")
        ax1.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", title=r["workload"][:60])
        ax2.set(xlabel="offered rate (req/s)", ylabel="P95 (ms)", yscale="log")
        ax1.legend()
        ax2.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"seed_{i}_{'profiled' if 'profiled' in r['workload'] else 'minilm'}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def oracle_curves(res: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _plt()
    rates = [r["rate_rps"] for r in res["rates"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(rates, [r["broker_goodput_rps"] for r in res["rates"]], "o-", lw=2, label="broker")
    for arm in res["grid"]:
        ax1.plot(rates, [r["static_goodput_rps"].get(arm, float("nan")) for r in res["rates"]], ".--", label=arm)
        ax2.plot(rates, [r["static_p95_ms"].get(arm, float("nan")) for r in res["rates"]], ".--", label=arm)
    ax2.plot(rates, [r["broker_p95_ms"] for r in res["rates"]], "o-", lw=2, label="broker")
    ax2.axhline(res["cap_ms"], color="k", ls="--", label="cap")
    ax1.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s within cap)", title="oracle sweep")
    ax2.set(xlabel="offered rate (req/s)", ylabel="P95 (ms)", yscale="log")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "oracle.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return [p]


def burst_series(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """burst: batch cap and quota per model over time, per arm (from GET /v1/status polls)."""
    plt = _plt()
    arms = list(res["arms"])
    fig, axes = plt.subplots(2, len(arms), figsize=(6 * len(arms), 6), sharex=True, squeeze=False)
    b = res["burst"]
    for j, arm in enumerate(arms):
        for n in res["models"]:
            s = res["arms"][arm]["series"][n]
            axes[0][j].plot(s["t_s"], s["max_batch_size"], label=n)
            axes[1][j].plot(s["t_s"], [(g or 0) / 2**20 for g in s["grant_bytes"]], label=n)
        for ax in (axes[0][j], axes[1][j]):
            ax.axvspan(b["start_s"], b["start_s"] + b["length_s"], color="orange", alpha=0.15)
        axes[0][j].set(title=f"{arm}: batch cap", ylabel="max_batch_size")
        axes[1][j].set(title=f"{arm}: quota grant", ylabel="MiB", xlabel="time (s)")
        axes[0][j].legend()
    fig.tight_layout()
    p = out_dir / "burst.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return [p]


def trace_curves(res: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for arm in ("broker", "static8"):
        rows = [r for r in res["rows"] if r["arm"] == arm]
        rates = sorted({r["rate_rps"] for r in rows})
        att = [
            sum(r["attainment"] for r in rows if r["rate_rps"] == x)
            / max(1, sum(1 for r in rows if r["rate_rps"] == x))
            for x in rates
        ]
        p95 = [max((r["p95_ms"] or float("nan")) for r in rows if r["rate_rps"] == x) for x in rates]
        ax1.plot(rates, att, "o-", label=arm)
        ax2.plot(rates, p95, "o-", label=arm)
    ax2.axhline(res["cap_ms"], color="k", ls="--", label="cap")
    ax1.set(xlabel="offered rate (req/s)", ylabel="SLO attainment", title="Azure code trace 2023")
    ax2.set(xlabel="offered rate (req/s)", ylabel="P95 (ms)", yscale="log")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    p = out_dir / "trace.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return [p]


PLOTS = {"seed": knee_curves, "oracle": oracle_curves, "burst": burst_series, "trace": trace_curves}


def plot(scenario: str, res: dict[str, Any], out_dir: Path) -> list[Path]:
    fn = PLOTS.get(scenario)
    if fn is None:
        return []
    try:
        return fn(res, out_dir)
    except ImportError:
        return []
