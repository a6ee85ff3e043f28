"""Byte sizes: parse "24GiB" / "1.5GB" into integer bytes, and format them back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) are
powers of 1000, as on a GPU spec sheet versus ``nvidia-smi``. ``Size`` is the pydantic type of
every size in the config: in a config file (``units_required`` in the validation context) a
size needs its unit, since ``base: 2`` would otherwise mean two bytes; code that builds a config
from a dict may still pass integer bytes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer, ValidationInfo

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
_AMBIGUOUS = ("k", "m", "g", "t")  # 1.5G: GiB or GB? a config file must say
UNITS_REQUIRED = "units_required"  # the validation-context key that makes a bare number an error

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


def check_unit(value: Any) -> None:
    """Refuse a size written without an unambiguous unit (a bare number, or K/M/G/T alone); 0 needs none."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return  # parse_size names what is wrong
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    number, unit = (match.group(1), match.group(2).lower()) if match else (value, "")
    if isinstance(value, str) and not match:
        return
    if float(number) == 0:
        return
    if unit == "":
        raise ValueError(
            f"{value!r} has no unit and would be read as {int(float(number))} bytes; write a unit, "
            f"e.g. '{number}GiB' ({int(float(number) * 1024**3)} bytes) or '{number}MiB' "
            f"({int(float(number) * 1024**2)} bytes); GB/MB are powers of 1000, GiB/MiB of 1024; B for bytes"
        )
    if unit in _AMBIGUOUS:
        up = unit.upper()
        raise ValueError(
            f"{value!r}: '{match.group(2) if match else unit}' could mean {up}iB (powers of 1024) or {up}B (powers of 1000); "
            f"write '{number}{up}iB' ({int(float(number) * _UNITS[unit])} bytes) "
            f"or '{number}{up}B' ({int(float(number) * _UNITS[unit + 'b'])} bytes)"
        )


def _validate(value: Any, info: ValidationInfo) -> int:
    if info.context and info.context.get(UNITS_REQUIRED):
        check_unit(value)
    return parse_size(value)


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


def _exact(num_bytes: int) -> str:
    text = format_size(num_bytes)
    return text if parse_size(text) == num_bytes else f"{num_bytes}B"


def exact_size(num_bytes: int) -> str:
    """The human form and, when it rounds, the exact byte count: ``1.4GiB (1500000000 bytes)``."""
    text = format_size(num_bytes)
    return text if num_bytes >= 0 and parse_size(text) == num_bytes else f"{text} ({num_bytes:,} bytes)"


# A size in the YAML ("24GiB", "512MB"; integer bytes from code): bytes in Python, human form when dumped.
Size = Annotated[int, BeforeValidator(_validate), PlainSerializer(format_size, return_type=str)]
# The same, dumped without rounding ("1.5GiB", else "1610612737B"): sizes a dump must give back exactly.
ExactSize = Annotated[int, BeforeValidator(_validate), PlainSerializer(_exact, return_type=str)]
