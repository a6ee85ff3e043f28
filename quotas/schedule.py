"""Price-aware profiles in the config: weekly windows (days, hours, timezone), each with a price
per GPU-hour and an objective; exactly one default. Validated here, chosen by ``gpubroker.broker.control.profiles``."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpubroker.quotas.vocab import Objective

DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_FULL_DAY_NAMES = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_HOURS_RE = re.compile(r"^(\d{1,2}):(\d{2})-(\d{1,2}):(\d{2})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def _day(name: str, item: str) -> int:
    """'mon' or 'monday' (any case) -> 0; anything else is refused, never read by its first letters."""
    word = name.strip().lower()
    for names in (DAY_NAMES, _FULL_DAY_NAMES):
        if word in names:
            return names.index(word)
    raise ValueError(
        f"'{name.strip()}' in '{item}' is not a day name; use mon, tue, wed, thu, fri, sat, sun (or the full "
        "names), a range such as mon-fri, a list such as sat,sun, or daily"
    )


def _parse_days(value: Any) -> tuple[int, ...]:
    """'mon-fri', 'sat,sun', ['mon', 'tue'] or 'daily' -> sorted weekday numbers (mon=0)."""
    if value in ("daily", "all", "*"):
        return tuple(range(7))
    items = value.split(",") if isinstance(value, str) else list(value)
    days: set[int] = set()
    for item in items:
        item = str(item).strip()
        if "-" in item:
            start, end = item.split("-", 1)
            i, j = _day(start, item), _day(end, item)
            days.update(range(i, j + 1) if i <= j else [*range(i, 7), *range(0, j + 1)])
        else:
            days.add(_day(item, item))
    return tuple(sorted(days))


def _parse_hours(value: str) -> tuple[int, int]:
    """'08:00-20:00' -> (480, 1200) minutes; end 24:00 allowed; end <= start wraps midnight."""
    match = _HOURS_RE.match(value.strip())
    if not match:
        raise ValueError(f"'{value}' is not an hour range; write HH:MM-HH:MM such as 08:00-20:00")
    h1, m1, h2, m2 = (int(x) for x in match.groups())
    if h1 > 23 or m1 > 59 or h2 > 24 or m2 > 59 or (h2 == 24 and m2 != 0):
        raise ValueError(f"'{value}' has an impossible time; hours run 00:00 to 24:00")
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == end:
        raise ValueError(f"'{value}' is empty (start equals end); widen it or use 00:00-24:00 for all day")
    return start, end


class ProfileSpec(_Strict):
    name: str = Field(description="Profile name shown in status and metrics.")
    objective: Objective = Field(
        Objective.BALANCED,
        description="throughput: larger batches within the slack; latency: smaller batches, tight caps.",
    )
    price_per_gpu_hour: float = Field(
        0.0, ge=0, description="Price of the card per hour in this window (for cost per 1k requests)."
    )
    latency_slack: float = Field(
        1.0, ge=0.5, le=5.0, description="Multiplier on every model's P95 cap in this window (e.g. 1.2 at peak)."
    )
    default: bool = Field(False, description="The profile used outside every window; exactly one profile is default.")
    days: str | list[str] | None = Field(
        None, description="Days of the window: mon-fri, [sat, sun], daily. Not set on the default."
    )
    hours: str | None = Field(
        None, description="Hours of the window, HH:MM-HH:MM in the schedule's timezone. Not set on the default."
    )

    @field_validator("days")
    @classmethod
    def _days(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None:
            _parse_days(value)
        return value

    @field_validator("hours")
    @classmethod
    def _hours(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_hours(value)
        return value

    @model_validator(mode="after")
    def _window(self) -> ProfileSpec:
        if self.default:
            if self.days is not None or self.hours is not None:
                raise ValueError("the default profile applies outside every window; remove its days/hours")
            return self
        if self.days is None or self.hours is None:
            raise ValueError("a non-default profile needs both days and hours (e.g. days: mon-fri, hours: 08:00-20:00)")
        return self

    def weekly_minutes(self) -> list[tuple[int, int]]:
        """The window as half-open [start, end) minute ranges within the week (mon 00:00 = 0)."""
        if self.default:
            return []
        start, end = _parse_hours(self.hours or "")
        out = []
        for day in _parse_days(self.days):
            base = day * 1440
            if end > start:
                out.append((base + start, base + end))
            else:  # wraps midnight: tail of this day, then the head of the next
                out.append((base + start, base + 1440))
                nxt = ((day + 1) % 7) * 1440
                out.append((nxt, nxt + end))
        return out


class ProfilesSection(_Strict):
    timezone: str = Field("UTC", description="IANA timezone the windows are written in, e.g. Europe/Berlin.")
    schedule: list[ProfileSpec] = Field(
        default_factory=lambda: [ProfileSpec(name="default", default=True)],
        description="Profiles: windows with price and objective, plus exactly one default.",
    )

    @field_validator("timezone")
    @classmethod
    def _tz(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"'{value}' is not an IANA timezone; write e.g. UTC or Europe/Berlin") from None
        return value

    @model_validator(mode="after")
    def _schedule(self) -> ProfilesSection:
        defaults = [p.name for p in self.schedule if p.default]
        if len(defaults) != 1:
            raise ValueError(
                f"schedule has {len(defaults)} default profiles ({', '.join(defaults) or 'none'}); mark exactly one with default: true"
            )
        names = [p.name for p in self.schedule]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"profile names repeat: {', '.join(dupes)}; give each profile its own name")
        spans = [(s, e, p.name) for p in self.schedule for (s, e) in p.weekly_minutes()]
        spans.sort()
        for (_s1, e1, n1), (s2, _e2, n2) in zip(spans, spans[1:]):
            if s2 < e1 and n1 != n2:
                day, minute = divmod(s2, 1440)
                raise ValueError(
                    f"windows of profiles '{n1}' and '{n2}' overlap on {DAY_NAMES[day]} at "
                    f"{minute // 60:02d}:{minute % 60:02d}; change their days or hours so they do not overlap"
                )
        return self

    @property
    def default_profile(self) -> ProfileSpec:
        return next(p for p in self.schedule if p.default)
