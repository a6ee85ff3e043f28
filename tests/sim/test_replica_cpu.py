"""bench/replica_cpu.py runs both arms on a real replica (Serve's batcher, no Ray): the thread arm
never goes inline, the inline arm does (no timing asserted)."""

from __future__ import annotations

import asyncio

from bench import replica_cpu


def test_both_arms_run_and_only_the_inline_arm_moves_validation_onto_the_loop(monkeypatch):
    made = replica_cpu._replica

    async def roomy(ckpt):  # noqa: ANN001, ANN202
        # The move inline waits for 16 validations in a row under 0.2 ms of wall time, which a
        # loaded machine can miss (seen in `make test`): wide bounds here, so only the arms'
        # wiring is tested; the thresholds themselves are tests/unit/test_inline_work.py's.
        r = await made(ckpt)
        r.validating.inline_below_ms, r.validating.back_above_ms = 50.0, 10_000.0
        return r

    monkeypatch.setattr(replica_cpu, "_replica", roomy)
    res = asyncio.run(replica_cpu.main_async(rounds=1, requests=80))
    by_mode = {r["mode"]: r for r in res["runs"]}
    assert by_mode["thread"]["inline"] is False and by_mode["inline"]["inline"] is True
    assert all(r["cpu_ms_per_request"] > 0 for r in res["runs"])
