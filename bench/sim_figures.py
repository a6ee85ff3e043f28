"""The simulator's headline figures, written as JSON under ``bench/results/sim/`` for the report.

Deterministic and cheap, so they are regenerated on the code they describe: the knee check of
each one-model profile (static 8 and the broker at the same cap 1.2·S, static 8 at S beside it,
the oracle over the eager and gated static grid, every knee held on seeds 0-2, every arm under
one ``ArmRules``), the formation × control ablation of the first profile (what wins the knee
gain) and the lending scenario. Each file records the command and the commit it ran on. Run::

    .venv/bin/python -m bench.sim_figures            # all, ~15 min on 2 cores
    .venv/bin/python -m bench.sim_figures --only knee-a20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpubroker.quotas.config import load_config
from gpubroker.sim.knee import ArmRules, RunSettings, seed_validation

OUT = Path("bench/results/sim")
SEEDS = (0, 1, 2)
PROFILES = {"knee-a20": "configs/sim-a20-c0.5.yaml", "knee-a10": "configs/sim-a10-c2.yaml"}


def code_version() -> dict[str, Any]:
    """The commit the figures ran on, and whether the tree differed from it in code they use."""

    def git(*args: str) -> str:  # porcelain lines start with a space: strip only the ends of lines
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.rstrip()

    status = git("status", "--porcelain", "--", "gpubroker", "broker", "deployments", "quotas", "bench")
    dirty = [p for p in (line[3:] for line in status.splitlines()) if p.endswith(".py") and "/results/" not in p]
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip(), "dirty_paths": dirty}


def knee_figures(config: str, say: Any) -> dict[str, Any]:
    return seed_validation(load_config(config), RunSettings(), rules=ArmRules(), seeds=SEEDS, on_progress=say)


def ablation_figures(config: str, say: Any) -> dict[str, Any]:
    from bench.ablation import ablation

    return ablation(load_config(config), RunSettings(), SEEDS, say=say)


def lending_figures(say: Any) -> dict[str, Any]:
    from bench import lending

    return lending.run(seeds=SEEDS, on_progress=say)


def jobs() -> dict[str, Any]:
    out: dict[str, Any] = {name: (lambda say, c=cfg: knee_figures(c, say)) for name, cfg in PROFILES.items()}
    out["ablation-a20"] = lambda say: ablation_figures(PROFILES["knee-a20"], say)
    out["lending"] = lending_figures
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma list of {', '.join(jobs())} (default: all)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    todo = jobs()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(todo)
    bad = [n for n in names if n not in todo]
    if bad:
        ap.error(f"--only {','.join(bad)}: not a figure; choose from {', '.join(todo)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0, code = time.time(), code_version()  # the code the run starts on
        doc = todo[name](lambda m, n=name: print(f"[{n}] {m}", file=sys.stderr, flush=True))
        doc["command"] = f"python -m bench.sim_figures --only {name}"
        doc["code"] = code
        doc["runtime_s"] = round(time.time() - t0, 1)
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {out / name}.json in {doc['runtime_s']:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
