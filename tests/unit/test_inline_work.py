"""gpubroker.deployments.replica.inline_work: cheap work goes inline after a warm run of quick measurements in the
thread; one slow inline run sends it back for the cooldown (no Ray, no model)."""

from __future__ import annotations

import asyncio
import threading

from gpubroker.deployments.replica.inline_work import InlineOrThread


def test_quick_runs_in_a_row_move_the_work_inline_and_one_slow_run_resets_the_count():
    g = InlineOrThread(inline_below_ms=0.2, warm=4)
    for _ in range(3):
        g.observe(0.05, inline=False)
    assert not g.inline()
    g.observe(0.5, inline=False)  # one slow run: the count starts again
    for _ in range(3):
        g.observe(0.05, inline=False)
    assert not g.inline() and g.quick_runs == 3
    g.observe(0.05, inline=False)
    assert g.inline()


def test_a_slow_inline_run_goes_back_to_the_thread_for_the_cooldown():
    g = InlineOrThread(warm=2, cooldown=3, back_above_ms=1.0)
    g.observe(0.01, inline=False)
    g.observe(0.01, inline=False)
    assert g.inline()
    g.observe(0.9, inline=True)  # under back_above_ms: stays
    assert g.inline()
    g.observe(5.0, inline=True)
    assert not g.inline() and g.fallbacks == 1
    for _ in range(3):  # the cooldown: quick runs do not count
        g.observe(0.01, inline=False)
    assert not g.inline() and g.quick_runs == 0
    g.observe(0.01, inline=False)
    g.observe(0.01, inline=False)
    assert g.inline()


def test_run_uses_a_thread_until_measured_cheap_then_the_loop():
    g = InlineOrThread(warm=3)
    seen: list[bool] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread() is threading.main_thread())
        return x * 2

    async def main() -> list[int]:
        return [await g.run(work, i) for i in range(6)]

    assert asyncio.run(main()) == [0, 2, 4, 6, 8, 10]
    assert seen == [False, False, False, True, True, True]  # three in the thread, then inline


def test_slow_work_stays_in_the_thread():
    g = InlineOrThread(warm=2, inline_below_ms=0.2)

    def slow() -> None:
        threading.Event().wait(0.002)  # 2 ms

    async def main() -> None:
        for _ in range(5):
            await g.run(slow)

    asyncio.run(main())
    assert not g.inline() and g.quick_runs == 0
