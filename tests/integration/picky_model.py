"""A plain-Python model that refuses or fails some inputs inside ``predict``, for
tests/integration/test_bad_input.py (imported by path by the replicas, like an operator's model).

Input ``{"text": str}``. A batch holding a text that starts with ``refuse`` raises ``InputError``,
one holding a text that starts with ``crash`` raises ``ValueError``; either error quotes EVERY
text of the batch, as a careless model's might, so an error that reached another client would
show. Each call appends one JSON line (the batch's texts, whether it raised) to
``<log_dir>/<pid>.jsonl``, so the test can see that good and bad inputs did share batches.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpubroker import InputError


class PickyModel:
    def __init__(self, log_dir: str = "", batch_s: float = 0.005):
        self.log_dir = log_dir
        self.batch_s = batch_s  # time a batch takes: requests arriving meanwhile batch together

    def validate(self, item):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise InputError("text", "expected a string")
        return {"text": item["text"]}

    def predict(self, items: list) -> list:
        texts = [item["text"] for item in items]
        everyone = ", ".join(texts)
        raised = any(t.startswith(("refuse", "crash")) for t in texts)
        self._log(texts, raised)
        time.sleep(self.batch_s)
        if any(t.startswith("refuse") for t in texts):
            raise InputError("text", f"refused: {everyone}")
        if raised:
            raise ValueError(f"cannot read {everyone}")
        return [{"echo": t, "length": len(t)} for t in texts]

    def _log(self, texts: list[str], raised: bool) -> None:
        if self.log_dir:
            with (Path(self.log_dir) / f"{os.getpid()}.jsonl").open("a", encoding="utf-8") as fh:
                fh.write(json.dumps({"texts": texts, "raised": raised}) + "\n")


def batches(log_dir: str | Path) -> list[dict]:
    """Every call the replicas logged: ``{"texts": [...], "raised": bool}``."""
    return [json.loads(line) for f in sorted(Path(log_dir).glob("*.jsonl")) for line in f.read_text().splitlines()]
