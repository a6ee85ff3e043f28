"""Errors, value checks and ``ModelQuota``, shared by the quota ledger's modules (``quotas.ledger``,
``quotas.transfers``, ``quotas.ledger_checks``). Stdlib only."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from quotas.sizes import format_size, parse_size

FREE_POOL = ""  # the name that stands for the free pool (reclaim_plan, release transfers)


class LedgerError(ValueError):
    """A refused ledger operation or bad ledger input; the message names model, bytes and fix."""

    def __init__(self, message: str, model: str | None = None):
        super().__init__(message)
        self.model = model


class LedgerInvariantError(LedgerError):
    """The ledger's state breaks one or more invariants; ``problems`` lists each one."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"quota ledger breaks {len(self.problems)} invariant(s):\n{lines}")


def fmt(num_bytes: int) -> str:
    """Human size, with the exact byte count when the human form rounds."""
    text = format_size(num_bytes)
    try:
        exact = parse_size(text.lstrip("-")) == abs(num_bytes)
    except ValueError:  # pragma: no cover - format_size always parses
        exact = False
    return text if exact else f"{text} ({num_bytes} bytes)"


def as_bytes(value: Any, what: str, model: str | None = None) -> int:
    """An integer byte count (ints and numpy-style integers; not bools, not floats)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        where = f" for '{model}'" if model else ""
        raise LedgerError(f"{what}{where} is {value!r}, not a whole number of bytes; pass an int", model)
    return operator.index(value)


def as_time(value: Any, what: str = "now_s") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise LedgerError(f"{what} is {value!r}; pass a finite number of seconds")
    return float(value)


@dataclass(frozen=True)
class ModelQuota:
    """One model's quota; validated on construction (integers, 0 <= min <= base <= max)."""

    min_bytes: int  # working set the model never goes under, even when it lends
    base_bytes: int  # guaranteed share: the owner can always reclaim it
    max_bytes: int  # most the model may borrow up to

    def __post_init__(self) -> None:
        for f in fields(self):
            value = as_bytes(getattr(self, f.name), f.name)
            if value < 0:
                raise LedgerError(f"{f.name} ({value}) is negative; quota sizes must be >= 0")
            object.__setattr__(self, f.name, value)
        if self.min_bytes > self.base_bytes:
            raise LedgerError(
                f"min_bytes ({fmt(self.min_bytes)}) is above base_bytes ({fmt(self.base_bytes)}); "
                "lower min or raise base"
            )
        if self.base_bytes > self.max_bytes:
            raise LedgerError(
                f"base_bytes ({fmt(self.base_bytes)}) is above max_bytes ({fmt(self.max_bytes)}); "
                "lower base or raise max"
            )

    def to_dict(self) -> dict[str, int]:
        return {"min_bytes": self.min_bytes, "base_bytes": self.base_bytes, "max_bytes": self.max_bytes}


def validate_quotas(quotas: Mapping[str, ModelQuota]) -> dict[str, ModelQuota]:
    if not isinstance(quotas, Mapping):
        raise LedgerError(f"quotas is {type(quotas).__name__}; pass a mapping of model name -> ModelQuota")
    out: dict[str, ModelQuota] = {}
    for name, quota in quotas.items():
        if not isinstance(name, str) or not name:
            raise LedgerError(f'model name {name!r} is not allowed; use a non-empty string ("" means the free pool)')
        if not isinstance(quota, ModelQuota):
            raise LedgerError(
                f"quota for '{name}' is {type(quota).__name__}; pass ModelQuota(min_bytes, base_bytes, max_bytes)", name
            )
        out[name] = quota
    return out
