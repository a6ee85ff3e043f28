"""``profiled``: an EMULATION of the simulator's model, for demos and tests without a real model.

It does no real compute. A batch of cost ``b`` (requests, or tokens when ``unit: tokens``)
sleeps ``a_ms + c_ms * b + token_ms * tokens`` milliseconds (time.sleep), holds a bytearray
of ``weights_bytes`` from load, allocates ``bytes_per_item * b`` transiently during predict,
and raises ``EmulatedOOM`` when weights + batch bytes exceed the limit set by
``set_memory_limit`` -- the same latency and memory model the simulator uses, so the broker
sees the same behaviour live as in simulation.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

from deployments.models.base import EmulatedOOM, InputError, ModelAdapter, require_fields


class ProfiledAdapter(ModelAdapter):
    """Input {"tokens": int} (optional, default 1) or {}; output {"ok": true, "batch": n, "cost": b}."""

    name = "profiled"
    OPTIONS = {
        "a_ms": 5.0,  # fixed cost per batch
        "c_ms": 1.0,  # cost per batch unit
        "token_ms": 0.0,  # extra cost per token, whatever the unit
        "weights_bytes": 0,  # held from load()
        "bytes_per_item": 0,  # per batch unit, allocated during predict
        "unit": "requests",  # "requests" or "tokens"
        "max_tokens": 1_000_000,  # larger inputs are refused with 422
    }

    def __init__(self, **options: Any):
        super().__init__(**options)
        if self.unit not in ("requests", "tokens"):
            raise ValueError(f"model 'profiled': option unit must be 'requests' or 'tokens', got {self.unit!r}")
        for key in ("a_ms", "c_ms", "token_ms", "weights_bytes", "bytes_per_item"):
            value = self.options[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"model 'profiled': option {key} must be a number >= 0, got {value!r}")
        self.cost_unit = self.unit  # instance attribute: the unit is an option here
        self._weights: bytearray | None = None

    def load(self, device: str) -> None:
        super().load(device)
        self._weights = bytearray(int(self.options["weights_bytes"]))

    def validate(self, item: Any) -> dict:
        data = require_fields(item if item is not None else {}, (), ("tokens",))
        tokens = data.get("tokens", 1)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise InputError("tokens", f"expected an integer >= 1, got {tokens!r}")
        if tokens > self.max_tokens:
            raise InputError("tokens", f"{tokens} is over the limit of {self.max_tokens}; send fewer tokens")
        return {"tokens": tokens}

    def _tokens(self, item: Any) -> int:
        return int(item.get("tokens", 1)) if isinstance(item, dict) else 1

    def cost(self, item: Any) -> int:
        return self._tokens(item) if self.unit == "tokens" else 1

    def predict(self, items: list) -> list:
        if not items:
            return []
        b = sum(self.cost(item) for item in items)
        tokens = sum(self._tokens(item) for item in items)
        need = int(self.bytes_per_item * b)
        held = len(self._weights) if self._weights is not None else self.weights_bytes()
        limit = self.memory_limit_bytes
        if limit is not None and held + need > limit:
            raise EmulatedOOM(
                f"profiled: batch of {b} {self.unit} needs {need} bytes on top of {held} weight bytes, "
                f"over the memory limit of {limit} bytes"
            )
        scratch = _transient(need)  # activations: resident while the batch runs, returned after
        try:
            time.sleep((self.a_ms + self.c_ms * b + self.token_ms * tokens) / 1000.0)
        finally:
            if scratch is not None:
                scratch.close()
        return [{"ok": True, "batch": len(items), "cost": b} for _ in items]

    def example_input(self, cost: int | None = None) -> dict:
        return {"tokens": int(cost)} if (cost and self.unit == "tokens") else {}

    def weights_bytes(self) -> int:  # type: ignore[override]
        return int(self.options["weights_bytes"])

    def declared_memory(self) -> tuple[int, float]:
        return int(self.options["weights_bytes"]), float(self.bytes_per_item)


_PAGE = mmap.PAGESIZE


def _transient(nbytes: int) -> mmap.mmap | None:
    """``nbytes`` of anonymous memory, every page touched (resident), unmapped on ``close()``.

    A plain ``bytearray`` goes through malloc: glibc raises its mmap threshold after the first
    large free, so later scratch comes from the heap and the process's resident memory never
    falls back. Host RSS stands in for VRAM on a machine without a GPU, so the emulation must
    give its activations back after each batch, as a GPU allocator's freed blocks do."""
    if nbytes <= 0:
        return None
    m = mmap.mmap(-1, nbytes)
    m[0:nbytes:_PAGE] = b"\x01" * len(range(0, nbytes, _PAGE))  # one write per page
    return m

