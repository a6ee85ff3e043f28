"""The replica's side of a reclaim's escalation: settings + local state -> actions. Pure.

The broker escalates a reclaim (or release) its borrower does not honour (``gpubroker.broker.control.lending``:
lower the cap, then release caches, then drain, then restart, each ``transfer_timeout_s``
after the previous) through three fields of ``ModelSettings``. This unit turns them into what
the replica does; ``gpubroker.deployments.replica.deployment`` only carries the actions out:

``release_cache``
    empty the allocator's caches (``MemoryLimiter.release_caches``: ``torch.cuda.empty_cache``
    on CUDA, ``malloc_trim`` on the host) once per settings version that carries it, so the
    next report measures what the model really holds;
``drain``
    pause admission: new requests get 503 with Retry-After, the batches already admitted run
    to the end, and their memory is freed with them;
``restart_token``
    the token in the first settings this process runs is its own; a later, larger token means
    "restart": ``check_health`` fails from then on (sticky), and Serve replaces the replica
    with a fresh process whose memory starts from nothing. A replica that starts *after* a
    restart was asked for reads the new token as its own and does not restart again.

No clock, no Serve, no torch: ``reclaim_step`` is a function of its arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpubroker.broker.wire import ModelSettings


@dataclass(frozen=True)
class ReclaimState:
    """What the replica remembers between settings."""

    start_token: int | None = None  # restart_token of the first settings this process ran
    emptied_version: int | None = None  # settings version whose release_cache was acted on
    failing: bool = False  # check_health fails from now on (Serve restarts the replica)


@dataclass(frozen=True)
class ReclaimActions:
    """What the replica does now."""

    empty_caches: bool = False  # release the allocator's caches and re-measure
    pause_admission: bool = False  # refuse new requests (503), let running batches finish
    fail_health: bool = False  # make check_health raise so Serve replaces this replica
    reason: str = ""  # one line for the replica's log


def reclaim_step(settings: ModelSettings, state: ReclaimState) -> tuple[ReclaimActions, ReclaimState]:
    """Actions for ``settings`` given ``state``; returns them with the new state."""
    start = settings.restart_token if state.start_token is None else state.start_token
    failing = state.failing or settings.restart_token > start
    empty = settings.release_cache and settings.version != state.emptied_version
    pause = settings.drain or failing
    parts = []
    if empty:
        parts.append(f"release_cache on settings v{settings.version}: empty caches and re-measure")
    if settings.drain:
        parts.append("drain: pause admission until the running batches finish")
    if failing:
        parts.append(
            f"restart_token {settings.restart_token} > {start} (started with): fail check_health so Serve restarts"
        )
    actions = ReclaimActions(empty_caches=empty, pause_admission=pause, fail_health=failing, reason="; ".join(parts))
    new_state = ReclaimState(
        start_token=start,
        emptied_version=settings.version if empty else state.emptied_version,
        failing=failing,
    )
    return actions, new_state


class ReplicaReclaim:
    """The replica's holder of ``reclaim_step``: the state between settings and the last actions.

    ``release_caches`` and ``log`` are injected (the replica passes its limiter's
    ``release_caches`` and its logger), so this too runs without Serve or torch."""

    def __init__(self, name: str, release_caches: Callable[[], None], log: Callable[[str], None]) -> None:
        self.name = name
        self.state = ReclaimState()
        self.actions = ReclaimActions()
        self._release = release_caches
        self._log = log

    def on_settings(self, settings: ModelSettings) -> ReclaimActions:
        """Feed the broker's settings (never the replica's own initial ones: the first token seen is its own)."""
        self.actions, self.state = reclaim_step(settings, self.state)
        if self.actions.reason:
            self._log(f"gpubroker replica {self.name}: {self.actions.reason}")
        if self.actions.empty_caches:
            try:
                self._release()
            except Exception as exc:  # noqa: BLE001 - a failed release must not take the replica down
                self._log(f"gpubroker replica {self.name}: release_caches failed: {exc!r}")
        return self.actions

    def check_health(self) -> None:
        """Raise once a restart was asked for, so Serve replaces this replica."""
        if self.actions.fail_health:
            raise RuntimeError(f"model '{self.name}': {self.actions.reason}")


__all__ = ["ReclaimActions", "ReclaimState", "ReplicaReclaim", "reclaim_step"]
