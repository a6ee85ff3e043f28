"""A replica over its grant: the watcher's decision, a pure function of readings and the clock.

The in-process limits (``gpubroker.deployments.enforce.limits``) bind only memory that goes through them, and any
code in the process can lift them. So a second layer measures: the process's use (resident
memory over its baseline on CPU, NVML's bytes for the pid on CUDA) over its grant plus slack for
longer than ``grace_s`` is a violation. The replica then refuses new work (503), drains, and its
process ends (Serve starts a new one). A soft limit found lifted is a violation at once.

Drivers: the watcher thread inside the replica and the watchdog process outside it
(``gpubroker.deployments.enforce.watch``), and the broker's policy from the reports (``over_grant``: a card-level
emergency pauses the model over its grant, not its neighbours). No clock, no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MiB = 1024**2
WATCH_SLACK_BYTES = 64 * MiB  # over the grant: the in-process limit's slack (32 MiB) + resident pages it does not count
WATCH_GRACE_S = 2.0  # over grant + slack for this long is a violation
WATCH_DRAIN_S = 3.0  # after a violation: new work refused, running batches end, then the process ends
WATCH_PERIOD_S = 0.25  # how often the watchers read the process
# A replica held over its grant restarts itself after this many transfer_timeout_s (the reclaim
# escalation's last step); a lowered grant binds the watchers one transfer timeout after that.
HELD_RESTART_T = 4


class Verdict(StrEnum):
    WITHIN = "within"  # at or under grant + slack
    OVER = "over"  # over grant + slack, inside the grace
    VIOLATION = "violation"  # over for longer than the grace, or a limit found lifted: refuse, drain, end
    END = "end"  # a violation that outlived the drain: end the process now


@dataclass(frozen=True)
class WatchLimits:
    grant_bytes: int  # this replica's grant
    slack_bytes: int = WATCH_SLACK_BYTES
    grace_s: float = WATCH_GRACE_S
    drain_s: float = WATCH_DRAIN_S

    def __post_init__(self) -> None:
        for field in ("grant_bytes", "slack_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        for field in ("grace_s", "drain_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0 seconds, got {getattr(self, field)}")

    @property
    def bound_bytes(self) -> int:
        return self.grant_bytes + self.slack_bytes


@dataclass(frozen=True)
class WatchState:
    over_since_s: float | None = None  # first reading over grant + slack in the current spell
    violation_s: float | None = None  # when the violation was declared (sticky: the process ends)
    why: str = ""  # the violation's reading, as declared


@dataclass(frozen=True)
class WatchResult:
    verdict: Verdict
    state: WatchState
    reason: str  # one line: the measurement, the grant, the step


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def watch_step(
    model: str, used_bytes: int, limits: WatchLimits, now_s: float, state: WatchState, lifted: str = ""
) -> WatchResult:
    """One reading of ``used_bytes`` (over the baseline) at ``now_s``; ``lifted``: a non-empty
    line when the in-process limit was found lifted (a violation at once)."""
    if state.violation_s is not None:  # sticky: refuse, drain, then end
        if now_s - state.violation_s >= limits.drain_s:
            return WatchResult(Verdict.END, state, f"{state.why}; drained {limits.drain_s:g}s: end the process")
        return WatchResult(Verdict.VIOLATION, state, state.why)
    if lifted:
        why = (
            f"model '{model}': {lifted}; uses {_mib(used_bytes)} on a grant of {_mib(limits.grant_bytes)}: "
            "refuse new work, drain, end the process"
        )
        return WatchResult(Verdict.VIOLATION, WatchState(state.over_since_s, now_s, why), why)
    reading = f"uses {_mib(used_bytes)} over grant {_mib(limits.grant_bytes)} + slack {_mib(limits.slack_bytes)}"
    if used_bytes <= limits.bound_bytes:
        return WatchResult(Verdict.WITHIN, WatchState(), "")
    since = now_s if state.over_since_s is None else state.over_since_s
    over_for = now_s - since
    if over_for < limits.grace_s:
        return WatchResult(
            Verdict.OVER,
            WatchState(since),
            f"model '{model}' {reading} for {over_for:.2f}s (grace {limits.grace_s:g}s)",
        )
    why = f"model '{model}' {reading} for {over_for:.2f}s > grace {limits.grace_s:g}s: refuse new work, drain, end the process"
    return WatchResult(Verdict.VIOLATION, WatchState(since, now_s, why), why)


@dataclass(frozen=True)
class GrantHold:
    """The grant the watchers hold as grants change: a lowered grant binds them only once the
    broker's reclaim escalation had its time (a donor holding over a lowered grant is the
    reclaim's to handle, not a violator)."""

    last_bytes: int | None = None  # the last grant seen
    floor_bytes: int | None = None  # the grant held while a lowered one waits
    until_s: float = 0.0  # when the floor goes


def lowered_grant_hold_s(transfer_timeout_s: float) -> float:
    """How long a lowered grant waits before it binds the watchers: the escalation's bound + one."""
    return (HELD_RESTART_T + 1) * transfer_timeout_s


def watched_grant(hold: GrantHold, grant_bytes: int, now_s: float, hold_s: float) -> tuple[int, GrantHold]:
    """The grant to watch at ``now_s`` for the broker's ``grant_bytes``, and the hold after it: a
    grant lower than the last one is watched as the higher one for ``hold_s``."""
    floor = hold.floor_bytes if hold.floor_bytes is not None and now_s < hold.until_s else None
    if hold.last_bytes is not None and grant_bytes < hold.last_bytes:
        floor = max(hold.last_bytes, floor or 0)
        hold = GrantHold(grant_bytes, floor, now_s + hold_s)
    else:
        hold = GrantHold(grant_bytes, floor, hold.until_s if floor is not None else 0.0)
    return (grant_bytes if floor is None else max(grant_bytes, floor)), hold


def over_grant(used_bytes: int, grant_bytes: int, replicas: int, slack_bytes: int = WATCH_SLACK_BYTES) -> bool:
    """A model's reported use (summed over its replicas) over its grant + each replica's slack:
    the broker's check from the reports."""
    return used_bytes > grant_bytes + max(1, replicas) * slack_bytes


__all__ = [
    "HELD_RESTART_T",
    "GrantHold",
    "lowered_grant_hold_s",
    "watched_grant",
    "WATCH_DRAIN_S",
    "WATCH_GRACE_S",
    "WATCH_PERIOD_S",
    "WATCH_SLACK_BYTES",
    "Verdict",
    "WatchLimits",
    "WatchResult",
    "WatchState",
    "over_grant",
    "watch_step",
]
