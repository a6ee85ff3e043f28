"""One number formatter for the simulator's and the live benchmarks' tables."""

from __future__ import annotations

from typing import Any


def fmt(x: Any, nd: int = 1) -> str:
    """``-`` for None, a float to ``nd`` decimals, anything else as str."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)
