"""How well RLIMIT_DATA holds a grant, measured against resident memory.

    .venv/bin/python -m bench.enforce_accuracy [--grants 64,256] [--json PATH]

Each row runs in a fresh child process: ``CpuRlimitLimiter`` (deployments/enforce/limits.py) measures
the child, takes the grant, then the child allocates with one pattern in 8 MiB steps until an
allocation fails (or 2x the grant is reached) and reports what it got. Columns:

- ``headroom``: soft limit minus VmData right after the limit is set (what the kernel will still
  give), MiB;
- ``got``: memory the pattern obtained before the first refusal, MiB;
- ``rss+``: peak resident memory over the child's baseline (VmRSS sampled after every step), MiB;
- ``error``: the exception the pattern's allocator raised (``-``: none, the limit did not bind).

Patterns: torch tensors (``ones``: every page written; ``empty``: reserved, never touched),
numpy arrays, bytearrays, private anonymous mmap, SHARED anonymous mmap (Python's default
``mmap.mmap(-1, n)``), a file-backed shared mmap, and threads (each reserves an 8 MiB stack).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
STEP_BYTES = 8 * MiB
PATTERNS = ("torch-ones", "torch-empty", "numpy", "bytearray", "mmap-private", "mmap-shared", "mmap-file", "threads")

CHILD = r"""
import json, mmap, sys, tempfile, threading
from gpubroker.deployments.enforce.probes import proc_status_bytes
from gpubroker.deployments.enforce.limits import CpuRlimitLimiter
from gpubroker.deployments.models import is_oom
MiB = 1024 ** 2
pattern, grant, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import numpy, torch  # imported before the baseline, as the replica imports torch first
lim = CpuRlimitLimiter(slack_bytes=0)
lim.start()
base_rss = proc_status_bytes()["VmRSS"]
lim.set_grant(grant)
headroom = lim.limit_bytes - proc_status_bytes()["VmData"]
held, got, peak, error = [], 0, 0, None
stop = threading.Event()

def one():
    n = step
    if pattern == "torch-ones":
        return torch.ones(n, dtype=torch.uint8)
    if pattern == "torch-empty":
        return torch.empty(n, dtype=torch.uint8)
    if pattern == "numpy":
        return numpy.ones(n, dtype=numpy.uint8)
    if pattern == "bytearray":
        return bytearray(b"\x01") * n
    if pattern in ("mmap-private", "mmap-shared"):
        flags = mmap.MAP_PRIVATE if pattern == "mmap-private" else mmap.MAP_SHARED
        m = mmap.mmap(-1, n, flags=flags | mmap.MAP_ANONYMOUS)
        m[0:n:4096] = b"\x01" * len(range(0, n, 4096))
        return m
    if pattern == "mmap-file":
        f = tempfile.TemporaryFile()
        f.truncate(n)
        m = mmap.mmap(f.fileno(), n)
        m[0:n:4096] = b"\x01" * len(range(0, n, 4096))
        return (f, m)
    if pattern == "threads":
        t = threading.Thread(target=stop.wait)
        t.start()
        return t
    raise SystemExit(f"unknown pattern {pattern}")

per = 8 * MiB if pattern == "threads" else step
while got < 2 * grant:
    try:
        held.append(one())
    except BaseException as exc:  # what the allocator raises past the limit
        error = f"{type(exc).__name__}" + (" (is_oom)" if is_oom(exc) else "")
        break
    got += per
    peak = max(peak, proc_status_bytes()["VmRSS"] - base_rss)
stop.set()
print(json.dumps({"pattern": pattern, "grant_mib": grant / MiB, "headroom_mib": headroom / MiB,
                  "got_mib": got / MiB, "rss_over_mib": peak / MiB, "error": error}))
"""


def measure(pattern: str, grant_bytes: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, pattern, str(grant_bytes), str(STEP_BYTES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        return {
            "pattern": pattern,
            "grant_mib": grant_bytes / MiB,
            "headroom_mib": None,
            "got_mib": None,
            "rss_over_mib": None,
            "error": f"child died ({out.returncode}): {out.stderr.strip()[-200:]}",
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    def cell(v) -> str:
        return "-" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))

    head = ("pattern", "grant", "headroom", "got", "rss+", "error")
    keys = ("pattern", "grant_mib", "headroom_mib", "got_mib", "rss_over_mib", "error")
    body = [[cell(r[k]) for k in keys] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grants", default="64,256", help="grants in MiB, comma-separated")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="allocation patterns, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print("RLIMIT_DATA is enforced on Linux only: nothing to measure here")
        return 0
    grants = [int(g) * MiB for g in args.grants.split(",") if g.strip()]
    rows = [measure(p, g) for g in grants for p in args.patterns.split(",") if p.strip()]
    print("MiB; units in the module docstring (rss+ is peak resident memory over the baseline)")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
