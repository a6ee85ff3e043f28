"""``make demo``'s comparison line (scripts/demo.py, not a package: loaded from its path)."""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

from gpubroker.quotas.config import parse_config_text

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("gpubroker_demo_script", ROOT / "scripts" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_burst_line_counts_only_the_burst_and_says_which_caps_and_grants_it_ran_at():
    demo = _demo()
    cfg = parse_config_text((ROOT / "configs" / "demo.yaml").read_text(encoding="utf-8"), "demo.yaml")
    args = Namespace(burst="prof", warm_s=10.0, burst_s=30.0)
    seen = [
        (5.0, "prof", 200, 50.0),  # warm-up: not the burst's
        (12.0, "prof", 200, 100.0),
        (13.0, "prof", 200, 400.0),  # over the 300 ms SLO
        (14.0, "prof", demo.SHED, 1.0),
        (15.0, "mlp", 200, 10.0),  # another model
        (41.0, "prof", 200, 10.0),  # cool-down
    ]
    watched = [(3.0, 1, 48 << 20), (12.0, 5, 57 << 20), (24.0, 48, 151 << 20), (45.0, 1, 48 << 20)]
    status = {"models": {"prof": {"grant_bytes": 48 << 20, "oom_splits": 0}}}
    line = demo.burst_line(seen, args, cfg, status, watched)
    assert "attainment  33.3%" in line and "requests 3" in line and "shed   1" in line
    assert "caps 5-48" in line and "grant up to 151.0MiB" in line
    assert "caps -" in demo.burst_line(seen, args, cfg, status, [])
