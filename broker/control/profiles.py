"""Price-aware profile selection: which schedule window holds ``now_s`` (epoch seconds).

Pure: the time comes in; the timezone conversion uses zoneinfo (data, not the clock).
"""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from gpubroker.quotas.schedule import ProfileSpec, ProfilesSection


def minute_of_week(now_s: float, timezone: str) -> int:
    local = datetime.fromtimestamp(now_s, ZoneInfo(timezone))
    return local.weekday() * 1440 + local.hour * 60 + local.minute


def active_profile(profiles: ProfilesSection, now_s: float) -> ProfileSpec:
    """The window containing now (windows never overlap: the config refuses it), else the default."""
    minute = minute_of_week(now_s, profiles.timezone)
    for profile in profiles.schedule:
        for start, end in profile.weekly_minutes():
            if start <= minute < end:
                return profile
    return profiles.default_profile


# Per objective: the most utilisation the batch plan aims for (lower = bigger batches, less
# GPU time per request, more waiting: throughput at peak; higher = smaller batches, tighter
# latency), and the cap's headroom over the planned batch for bursts.
RHO_MAX = {"latency": 0.95, "balanced": 0.9, "throughput": 0.7}
BATCH_HEADROOM = {"latency": 3.0, "balanced": 4.0, "throughput": 6.0}
