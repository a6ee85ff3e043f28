"""User models that do not cooperate with their grant (issue 37), imported by path like an
operator's model. Each keeps what it allocates, ``{"mb": N}`` per request, for the life of the
process (``{"mb": 0}`` allocates nothing: the request a restarted replica answers).

- ``LifterModel``: raises its own soft ``RLIMIT_DATA`` to the hard limit before it allocates
  (any code in the process can), and keeps torch tensors.
- ``SneakyLifterModel``: the same, but puts the soft limit back after each allocation, so the
  limit reads as set when the replica checks it: only the measurement sees it.
- ``OutsideModel``: allocates outside torch: ``how`` = ``numpy`` (a numpy array over an
  anonymous shared mapping, ``mmap.mmap(-1, n)``: not counted by ``RLIMIT_DATA``), ``bytearray``
  (private heap: counted, so the in-process limit refuses it first).
"""

from __future__ import annotations

import mmap
import resource

MiB = 1024**2
_KEPT: list = []  # what the model keeps: module-level, so nothing frees it


def _validate(item, max_mb: int = 4096):
    from gpubroker.deployments.models import InputError

    mb = item.get("mb") if isinstance(item, dict) else None
    if isinstance(mb, bool) or not isinstance(mb, int) or not 0 <= mb <= max_mb:
        raise InputError("mb", f"expected an integer in [0, {max_mb}], got {mb!r}")
    return {"mb": mb}


def _lift() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    return soft, hard


class LifterModel:
    restore = False

    def load(self, device: str) -> None:
        self.device = device

    def validate(self, item):
        return _validate(item)

    def predict(self, items):
        import torch

        out = []
        for item in items:
            if item["mb"]:
                soft, hard = _lift()
                _KEPT.append(torch.ones(item["mb"] * MiB, dtype=torch.uint8))  # every page written
                if self.restore:
                    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
            out.append({"mb": item["mb"], "kept_mb": sum(int(t.numel()) for t in _KEPT) // MiB})
        return out

    def example_input(self, cost=None):
        return {"mb": 0}


class SneakyLifterModel(LifterModel):
    restore = True


class OutsideModel:
    def __init__(self, how: str = "numpy"):
        if how not in ("numpy", "bytearray"):
            raise ValueError(f"how must be numpy or bytearray, got {how!r}")
        self.how = how

    def load(self, device: str) -> None:
        self.device = device

    def validate(self, item):
        return _validate(item)

    def predict(self, items):
        import numpy as np

        for item in items:
            n = item["mb"] * MiB
            if not n:
                continue
            if self.how == "numpy":
                buf = mmap.mmap(-1, n)  # MAP_SHARED | MAP_ANONYMOUS: outside RLIMIT_DATA's count
                arr = np.frombuffer(buf, dtype=np.uint8)
                arr[:] = 1  # every page written
                _KEPT.append((buf, arr))
            else:
                _KEPT.append(bytearray(b"\x01") * n)
        return [{"mb": item["mb"], "kept": len(_KEPT)} for item in items]

    def example_input(self, cost=None):
        return {"mb": 0}
