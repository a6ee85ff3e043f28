"""gpubroker.deployments.llm.reaper: engine processes end with the process that started them, even a SIGKILLed one.

Real processes throughout: a parent started here tracks a child of its own (a stand-in engine, or
vLLM's engine core in the second test), prints the pids, and is SIGKILLed; the test then waits
for the tracked processes to go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from gpubroker.deployments.llm.reaper import Reaper, descendants, start_time

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still alive after waiting up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if start_time(p) is not None and not _zombie(p)]
    return alive


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def _killed_parent(script: str, timeout_s: float) -> list[int]:
    """Run ``script`` (it prints "PIDS" and the pids it tracked on one line, then sleeps); SIGKILL it; those pids."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        line = ""
        while parent.stdout is not None and not line.startswith("PIDS"):  # vLLM logs to stdout too
            line = parent.stdout.readline() or "PIDS (the parent ended)"
        pids = [int(p) for p in line.split()[1:] if p.isdigit()]
        assert pids, f"the parent tracked nothing (printed {line!r})"
        assert all(start_time(p) is not None for p in pids)
    finally:
        parent.kill()
        parent.wait(timeout=timeout_s)
    return pids


def test_a_killed_parent_takes_its_tracked_children_with_it():
    script = """
        import os, subprocess, sys, time
        from gpubroker.deployments.llm.reaper import REAPER, descendants
        before = descendants(os.getpid())
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("PIDS", *REAPER.track(descendants(os.getpid()) - before), flush=True)
        time.sleep(600)
    """
    pids = _killed_parent(script, 10)
    assert _gone_within(pids, 20) == []


def test_a_watcher_that_ended_is_replaced_and_handed_everything_held():
    script = """
        import os, subprocess, sys, time
        from gpubroker.deployments.llm.reaper import REAPER, descendants
        def engine():
            before = descendants(os.getpid())
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            return REAPER.track(descendants(os.getpid()) - before)
        first = engine()
        REAPER._proc.kill(); REAPER._proc.wait()  # the watcher is gone: the next track starts another
        second = engine()
        print("PIDS", *first, *second, flush=True)
        time.sleep(600)
    """
    pids = _killed_parent(script, 10)
    assert len(pids) == 2 and _gone_within(pids, 20) == []


def test_an_ended_process_is_forgotten_and_an_untracked_one_survives():
    reaper = Reaper()
    keep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert reaper.track({short.pid}) == [short.pid]
        short.wait(timeout=10)
        reaper.forget_gone()
        assert short.pid not in reaper.tracked()
        assert keep.pid in descendants(os.getpid())
        assert reaper.track({999_999_999}) == []  # no such process: nothing to hold
    finally:
        keep.kill()
        keep.wait(timeout=10)


def test_vllm_engine_processes_end_with_a_killed_replica():
    pytest.importorskip("vllm")
    script = """
        import asyncio, time
        from gpubroker.deployments.llm.reaper import REAPER
        from gpubroker.deployments.llm.tiny_model import ensure_tiny_llama
        from gpubroker.deployments.llm.vllm_engine import VllmEngine, VllmEngineOptions

        async def main():
            engine = VllmEngine(VllmEngineOptions(model_dir=str(ensure_tiny_llama()), max_model_len=256,
                                                  kv_cache_blocks=4, kv_cache_blocks_min=3, in_process=False))
            await engine.start()
            print("PIDS", *REAPER.tracked(), flush=True)
            await asyncio.sleep(600)

        if __name__ == "__main__":
            asyncio.run(main())
    """
    pids = _killed_parent(script, 30)  # vLLM's engine core (and its CPU worker)
    assert _gone_within(pids, 30) == []
