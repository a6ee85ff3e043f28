"""The last step of a reclaim's escalation on real Ray Serve (CPU): a replica whose settings carry
a larger ``restart_token`` fails its health check (``gpubroker.deployments.replica.reclaim.ReplicaReclaim``, wired
as in ``gpubroker.deployments.replica.deployment``) and Serve replaces it with a fresh process.

This measures the ``restart`` term of the bound in ``gpubroker.broker.control.lending`` (3 T + restart +
stale_after_s + control_interval_s) with the health-check period the fleet deploys with
(``gpubroker.deployments.app``: 5 s); it prints the figure and asserts only that the process was
replaced and the replacement keeps running on the same token.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.integration.conftest import wait_for

# slow: a replica restarted by the reclaim escalation; `make chaos` runs it, `make test` does not
pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEALTH_CHECK_PERIOD_S = 5  # what gpubroker.deployments.app gives every model deployment


class Holder:
    """The replica's reclaim glue and nothing else: settings in, check_health out."""

    def __init__(self, token: int):
        from gpubroker.broker.wire import ModelSettings
        from gpubroker.deployments.replica.reclaim import ReplicaReclaim

        self.reclaim = ReplicaReclaim("holder", lambda: None, print)
        self.base = ModelSettings(
            model="holder", version=1, max_batch_size=1, batch_wait_timeout_s=0.0, grant_bytes=1, restart_token=token
        )
        self.reclaim.on_settings(self.base)  # the broker's settings at register: its own token

    def settings(self, version: int, token: int) -> dict:
        from dataclasses import replace

        actions = self.reclaim.on_settings(replace(self.base, version=version, restart_token=token))
        return {"fail_health": actions.fail_health, "pause_admission": actions.pause_admission}

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        self.reclaim.check_health()


def test_restart_token_makes_serve_replace_the_replica():
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        app = (
            serve.deployment(Holder)
            .options(
                name="holder",
                num_replicas=1,
                health_check_period_s=HEALTH_CHECK_PERIOD_S,
                graceful_shutdown_timeout_s=5,
                ray_actor_options={"num_cpus": 0.1},
            )
            .bind(0)
        )
        handle = serve.run(app, name="reclaim-restart", route_prefix=None)
        old = handle.pid.remote().result(timeout_s=60)
        asked = time.monotonic()
        actions = handle.settings.remote(2, 1).result(timeout_s=30)
        assert actions == {"fail_health": True, "pause_admission": True}

        def replaced() -> bool:
            try:
                return handle.pid.remote().result(timeout_s=10) != old
            except Exception:  # noqa: BLE001 - the old replica is going away
                return False

        wait_for(replaced, 120, what="Serve replaced the replica that failed its health check")
        restart_s = time.monotonic() - asked
        print(
            f"restart term of the reclaim bound: {restart_s:.1f} s from the token to a new process answering "
            f"(health_check_period_s {HEALTH_CHECK_PERIOD_S})"
        )
        # the replacement (started with token 0 from Holder's init, as a new replica registers with
        # the broker's current token) runs on; a token it has seen does not restart it again
        new = handle.pid.remote().result(timeout_s=30)
        assert new != old
        assert handle.settings.remote(3, 0).result(timeout_s=30)["fail_health"] is False
        serve.delete("reclaim-restart")
    finally:
        serve.shutdown()
        ray.shutdown()
