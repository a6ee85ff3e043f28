"""``CountingMlp``: the built-in ``mlp`` that leaves a trace of every ``predict`` call on disk.

The reliability tests need to know, from outside the replica process, whether a request
reached the model and which process served it: ``load`` writes ``<count_dir>/pid-<pid>``,
every ``predict`` appends the batch size to ``<count_dir>/calls-<pid>``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpubroker.deployments.models.mlp import MlpAdapter


class CountingMlp(MlpAdapter):
    name = "counting-mlp"
    OPTIONS = {**MlpAdapter.OPTIONS, "count_dir": ""}

    def load(self, device: str) -> None:
        super().load(device)
        if self.count_dir:
            Path(self.count_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.count_dir) / f"pid-{os.getpid()}").write_text(str(os.getpid()))

    def predict(self, items: list) -> list:
        if self.count_dir:
            with open(Path(self.count_dir) / f"calls-{os.getpid()}", "a", encoding="ascii") as fh:
                fh.write(f"{len(items)}\n")
        return super().predict(items)


def calls(count_dir: str | Path) -> dict[int, list[int]]:
    """pid -> batch sizes of every predict call so far."""
    out: dict[int, list[int]] = {}
    for p in Path(count_dir).glob("calls-*"):
        out[int(p.name[6:])] = [int(x) for x in p.read_text().split()]
    return out


def pids(count_dir: str | Path) -> list[int]:
    return sorted(int(p.name[4:]) for p in Path(count_dir).glob("pid-*"))


def _unused(_: Any) -> None:  # keep the module import-light for Ray workers
    return None
