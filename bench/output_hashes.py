"""Hashes of what the control plane outputs, to check that a change to its speed changed nothing.

A refactor of the window, the rules or the broker core must give the same answers. This runs
``bench.scale``'s synthetic fleets on a fake clock (seed 3; 16 cards x 100 models, 1 x 100,
1 x 10; 150 s each) and hashes every settings reply, the decision log and the final status, and
the simulator's broker arm on 100 models x 300 s of trace arrivals (without its wall time). Run
it on two trees and compare the lines:

    python -m bench.output_hashes            # one line per case
    git worktree add /tmp/base <commit> && (cd /tmp/base && python -m bench.output_hashes)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Any

from bench.scale import _Cores, synthetic_config, synthetic_doc


def digest(obj: Any) -> str:
    """A short hash of ``obj`` as sorted JSON (dataclasses as dicts, tuples and sets as lists)."""

    def plain(o: Any) -> Any:
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        return str(o)

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=plain).encode()).hexdigest()[:16]


def scale_hashes(cards: int, models: int, seconds: float, seed: int = 3) -> tuple[str, str, str]:
    """(replies, decision log, status) of ``models`` models over ``cards`` cards after ``seconds``."""
    cores = _Cores(synthetic_doc(models, cards=cards), seed)
    replies: list[Any] = []  # ModelSettings (hashed as their fields)
    report = cores.broker.report

    def recording(rep: Any, *args: Any) -> Any:
        out = report(rep, *args)
        replies.append(out)
        return out

    cores.broker.report = recording
    cores.run(seconds)
    status = cores.broker.status()
    return digest(replies), digest(cores.broker.decisions()), digest(_without(status, "checkpoint_path"))


def sim_hash(models: int = 100, seconds: float = 300.0, seed: int = 0) -> str:
    from gpubroker.sim.engine import SimOptions, run_sim

    cfg = synthetic_config(models)
    res = dataclasses.asdict(
        run_sim(cfg, "broker", {n: 0.5 for n in cfg.models}, seconds, arrivals="trace", opts=SimOptions(seed=seed))
    )
    res.pop("wall_s", None)
    return digest(res)


def _without(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        return {k: _without(v, key) for k, v in obj.items() if k != key}
    if isinstance(obj, list):
        return [_without(v, key) for v in obj]
    return obj


def main() -> None:
    for cards, models in ((16, 100), (1, 100), (1, 10)):
        print(f"{cards}x{models}", *scale_hashes(cards, models, 150.0))
        sys.stdout.flush()
    print("sim", sim_hash())


if __name__ == "__main__":
    main()
