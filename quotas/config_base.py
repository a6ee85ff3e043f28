"""Building blocks of the config schema: sizes and the strict base model (pure, pydantic v2)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from quotas.sizes import format_size, parse_size

DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def _size(value: Any) -> int:
    return parse_size(value)


# A size in the YAML ("24GiB", "512MB", 1048576): bytes in Python, human form when dumped.
Size = Annotated[int, BeforeValidator(_size), PlainSerializer(format_size, return_type=str)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
