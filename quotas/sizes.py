"""Byte sizes: parse "24GiB" / "512MB" / 1048576 into integer bytes, and format them back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) are
powers of 1000, as on a GPU spec sheet versus ``nvidia-smi``. A bare number is bytes.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return ``value`` in bytes. Raises ``ValueError`` naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; write a number of bytes or e.g. '512MiB', '24GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size {value!r} is negative; sizes must be >= 0")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a size; write a number of bytes or e.g. '512MiB', '24GiB'")
    text = value.strip()
    if text.startswith("-"):
        raise ValueError(f"size {value!r} is negative; sizes must be >= 0")
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{value!r} is not a size; write e.g. '512MiB', '24GiB', '1.5GB' or a number of bytes")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{value!r} has unknown unit {unit!r}; use one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB")
    return int(float(number) * factor)


def format_size(num_bytes: int | float | None) -> str:
    """Human form with binary units, e.g. ``1.5GiB``; ``-`` for None."""
    if num_bytes is None:
        return "-"
    sign = "-" if num_bytes < 0 else ""
    n = abs(float(num_bytes))
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{sign}{n / factor:.1f}{unit}"
    return f"{sign}{int(n)}B"
