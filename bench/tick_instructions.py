"""Instructions per control tick, counted under valgrind: a speed measure that holds across machines.

Wall-clock tick times on shared machines move too much to show a change of a few percent; the
instructions callgrind counts for the same code, inputs and hash seed (``PYTHONHASHSEED=0``) do
not. This runs ``bench.scale``'s synthetic fleet under callgrind three times: the warm-up only;
the warm-up then ``seconds`` of reports and ticks; the warm-up then reports only. Ticks cost the
second minus the third, reports the third minus the first, per tick and report round. ``--tree
DIR`` runs another checkout the same way. valgrind comes from the system (Debian: ``apt-get
install valgrind``); without it this says so and exits 2. A tool for speed work, not a test.

    python -m bench.tick_instructions                     # 16 cards x 100 models, 20 s
    python -m bench.tick_instructions --tree /tmp/base    # the same for another checkout
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WARMUP_S = 30.0
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


# What valgrind runs, in the tree's directory (python -c: the tree's broker and bench.scale, never
# this checkout's): the warm-up, then SECONDS of MODE ("ticks": reports and ticks; "reports": the
# tick replaced by nothing).
_CHILD = """
import sys
from bench.scale import _Cores, synthetic_doc
cards, models, seconds, mode, warmup = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
cores = _Cores(synthetic_doc(models, cards=cards), seed=0)
cores.run(warmup)
if mode == "reports":
    cores.broker.tick = lambda: None
if seconds > 0:
    cores.run(seconds)
"""


def _count(tree: Path, cards: int, models: int, seconds: float, mode: str) -> int:
    """Instructions callgrind counted for one child run in ``tree``."""
    with tempfile.TemporaryDirectory(prefix="gpubroker-cg-") as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/callgrind.out",
            sys.executable,
            "-c",
            _CHILD,
        ]
        cmd += [str(cards), str(models), str(seconds), mode, str(WARMUP_S)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree)}
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(proc.stderr)
    if proc.returncode != 0 or found is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"callgrind run ({mode}, {seconds:g} s) in {tree} failed (exit {proc.returncode}):\n{tail}")
    return int(found.group(1))


def measure(
    tree: Path,
    cards: int = 16,
    models: int = 100,
    seconds: float = 20.0,
    say: Any = print,
    *,
    control_interval_s: float = 1.0,  # bench.scale's CONTROL_INTERVAL_S (passed by it; a test checks the default)
    report_interval_s: float = 0.5,  # bench.scale's REPORT_INTERVAL_S
) -> dict[str, Any]:
    """Instructions per tick and per report round of ``tree``'s broker core (module docstring).
    The intervals are passed in, not imported: bench.scale imports this module."""
    runs = {"warmup": (0.0, "ticks"), "ticks": (seconds, "ticks"), "reports": (seconds, "reports")}
    say(f"{tree}: 3 callgrind runs of {cards} cards x {models} models, two at a time (about 2 x 100 s) ...")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(_count, tree, cards, models, s, m) for k, (s, m) in runs.items()}
        got = {k: f.result() for k, f in futures.items()}
    ticks = int(round(seconds / control_interval_s))
    rounds = int(round(seconds / report_interval_s))
    return {
        "tree": str(tree),
        "cards": cards,
        "models": models,
        "seconds": seconds,
        "instructions": got,
        "per_tick": round((got["ticks"] - got["reports"]) / ticks),
        "per_report_round": round((got["reports"] - got["warmup"]) / rounds),
        "reports_per_round": models,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tick_instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--cards", type=int, default=16, help="emulated cards (default 16)")
    ap.add_argument("--models", type=int, default=100, help="models in all (default 100)")
    ap.add_argument("--seconds", type=float, default=20.0, help="fake-clock seconds counted after the warm-up")
    ap.add_argument("--tree", type=Path, default=Path.cwd(), help="the checkout to count (default: here)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: on Debian, apt-get install valgrind", file=sys.stderr)
        return 2
    if args.cards < 1 or args.models < args.cards or args.seconds <= 0:
        ap.error("--cards must be >= 1, --models >= --cards, --seconds > 0")
    tree = args.tree.resolve()
    if not (tree / "bench" / "scale.py").is_file():
        ap.error(f"--tree {tree} is not a gpubroker checkout (no bench/scale.py)")
    res = measure(tree, args.cards, args.models, args.seconds, say=lambda m: print(m, file=sys.stderr))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
