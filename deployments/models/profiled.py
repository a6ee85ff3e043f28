"""``profiled``: an EMULATION of the simulator's model, for demos and tests without a real model.

Its options are the model's ``profile:`` figures (``gpubroker.quotas.config`` copies them in, sizes in
bytes), so it serves the latency and memory that ``simulate`` emulates for it.
It does no real compute. A batch of cost ``b`` (requests, or tokens when ``unit: tokens``)
sleeps ``a_ms + c_ms * b + token_ms * tokens`` milliseconds (time.sleep), holds
``weights_bytes`` of touched memory from load, and allocates ``bytes_per_item * b`` of touched
memory while the batch runs -- the same latency and memory model the simulator uses. It does
not check its grant itself: its memory is real (private anonymous pages, which RLIMIT_DATA
counts), so the replica's limiter (``gpubroker.deployments.enforce.limits``) refuses a batch past the grant the
way it refuses a real model's, and that failure surfaces as ``EmulatedOOM`` (a MemoryError).
"""

from __future__ import annotations

import errno
import mmap
import time
from typing import Any

from gpubroker.deployments.models.base import EmulatedOOM, InputError, ModelAdapter, require_fields


class ProfiledAdapter(ModelAdapter):
    """Input {"tokens": int} (optional, default 1) or {}; output {"ok": true, "batch": n, "cost": b}."""

    name = "profiled"
    OPTIONS = {
        "a_ms": 5.0,  # fixed cost per batch
        "c_ms": 1.0,  # cost per batch unit
        "token_ms": 0.0,  # extra cost per token, whatever the unit
        "weights_bytes": 0,  # held (touched) from load()
        "bytes_per_item": 0,  # per batch unit, allocated (touched) during predict
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
        self._weights: mmap.mmap | None = None

    def load(self, device: str) -> None:
        super().load(device)
        self._weights = _touched(int(self.options["weights_bytes"]), "weights")

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
        scratch = _touched(need, f"a batch of {b} {self.unit}")  # activations: resident while the batch runs
        try:
            time.sleep((self.a_ms + self.c_ms * b + self.token_ms * tokens) / 1000.0)
        finally:
            if scratch is not None:
                scratch.close()  # returned after the batch, as a GPU allocator's freed blocks are
        return [{"ok": True, "batch": len(items), "cost": b} for _ in items]

    def example_input(self, cost: int | None = None) -> dict:
        return {"tokens": int(cost)} if (cost and self.unit == "tokens") else {}

    def weights_bytes(self) -> int:  # type: ignore[override]
        return int(self.options["weights_bytes"])

    def declared_memory(self) -> tuple[int, float]:
        return int(self.options["weights_bytes"]), float(self.bytes_per_item)


_PAGE = mmap.PAGESIZE


def _touched(nbytes: int, what: str) -> mmap.mmap | None:
    """``nbytes`` of private anonymous memory, every page touched (resident), unmapped on ``close()``.

    Private, not Python's default shared mapping: RLIMIT_DATA counts private writable mappings
    and not shared ones, so only this way does the replica's limit hold the emulation. Not a
    ``bytearray``: glibc raises its mmap threshold after the first large free, so later scratch
    would come from the heap and the process's resident memory would never fall back (host RSS
    stands in for VRAM here). Past the limit the mapping fails with ENOMEM: ``EmulatedOOM``."""
    if nbytes <= 0:
        return None
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise EmulatedOOM(f"profiled: {what} needs {nbytes} bytes: can't allocate memory ({exc.strerror})") from None
    m[0:nbytes:_PAGE] = b"\x01" * len(range(0, nbytes, _PAGE))  # one write per page
    return m
