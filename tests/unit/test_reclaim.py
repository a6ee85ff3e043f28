"""deployments/replica/reclaim.py: the replica's reaction to a reclaim's escalation, without Serve."""

from __future__ import annotations

from dataclasses import replace

from gpubroker.broker.wire import ModelSettings
from gpubroker.deployments.replica.reclaim import ReclaimActions, ReclaimState, reclaim_step

BASE = ModelSettings(model="m", version=3, max_batch_size=8, batch_wait_timeout_s=0.0, grant_bytes=1 << 30)


def run(*settings: ModelSettings, state: ReclaimState | None = None) -> list[ReclaimActions]:
    state = state or ReclaimState()
    out = []
    for s in settings:
        actions, state = reclaim_step(s, state)
        out.append(actions)
    return out


def test_plain_settings_do_nothing():
    (a,) = run(BASE)
    assert a == ReclaimActions()


def test_release_cache_empties_once_per_version():
    s4 = replace(BASE, version=4, release_cache=True)
    s5 = replace(s4, version=5)
    a = run(BASE, s4, s4, s5)
    assert [x.empty_caches for x in a] == [False, True, False, True]
    assert "empty caches" in a[1].reason
    assert not any(x.pause_admission or x.fail_health for x in a)


def test_drain_pauses_admission_and_lifts_when_cleared():
    drain = replace(BASE, version=4, release_cache=True, drain=True)
    done = replace(BASE, version=5)
    a = run(BASE, drain, done)
    assert [x.pause_admission for x in a] == [False, True, False]
    assert not any(x.fail_health for x in a)


def test_larger_restart_token_fails_health_for_good():
    restart = replace(BASE, version=4, release_cache=True, drain=True, restart_token=1)
    after = replace(BASE, version=5, restart_token=1)  # the reclaim completed meanwhile
    a = run(BASE, restart, after)
    assert [x.fail_health for x in a] == [False, True, True]
    assert a[1].pause_admission and a[2].pause_admission
    assert "restart_token 1 > 0" in a[1].reason


def test_replica_started_after_the_restart_keeps_running():
    """The replacement registers with token 1 already set: that is its own token."""
    started = replace(BASE, version=6, restart_token=1)
    a = run(started, replace(started, version=7))
    assert not any(x.fail_health for x in a)
    again = run(started, replace(started, version=8, restart_token=2))
    assert again[-1].fail_health


def test_replica_holder_releases_logs_and_fails_health():
    from gpubroker.deployments.replica.reclaim import ReplicaReclaim

    released, lines = [], []
    holder = ReplicaReclaim("m", lambda: released.append(1), lines.append)
    holder.check_health()  # healthy before anything
    holder.on_settings(BASE)
    holder.on_settings(replace(BASE, version=4, release_cache=True))
    assert released == [1] and "empty caches" in lines[-1]
    holder.on_settings(replace(BASE, version=5, release_cache=True, drain=True, restart_token=1))
    assert holder.actions.pause_admission
    import pytest

    with pytest.raises(RuntimeError, match="restart_token 1 > 0"):
        holder.check_health()


def test_replica_holder_survives_a_failing_release():
    from gpubroker.deployments.replica.reclaim import ReplicaReclaim

    def boom() -> None:
        raise OSError("no allocator")

    lines: list[str] = []
    holder = ReplicaReclaim("m", boom, lines.append)
    holder.on_settings(BASE)
    actions = holder.on_settings(replace(BASE, version=4, release_cache=True))
    assert actions.empty_caches and "release_caches failed" in lines[-1]
