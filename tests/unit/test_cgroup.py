"""The per-replica memory cgroup writer (``gpubroker.deployments.enforce.cgroup``): against a temporary directory
laid out like cgroupfs (v1 and v2), and once for real under /sys/fs/cgroup/memory where this
machine lets us write (a child of this process's cgroup, removed after)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpubroker.deployments.enforce.cgroup import CGROUP_MARGIN_BYTES, CgroupVersion, ReplicaCgroup, find_place

MiB = 1024**2


def fake_v1(tmp_path: Path) -> tuple[Path, Path]:
    proc, fs = tmp_path / "proc", tmp_path / "cg"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text("9:pids:/\n4:memory:/process_api/abc\n0::/\n")
    (fs / "memory" / "process_api" / "abc").mkdir(parents=True)
    return proc, fs


def test_v1_place_is_the_memory_controllers_cgroup(tmp_path):
    proc, fs = fake_v1(tmp_path)
    place = find_place(42, proc, fs)
    assert place.version == CgroupVersion.V1 and place.parent == fs / "memory" / "process_api" / "abc"
    assert place.writable


def test_v2_place_needs_the_memory_controller(tmp_path):
    proc, fs = tmp_path / "proc", tmp_path / "cg"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/user.slice/app\n")
    (fs / "user.slice" / "app").mkdir(parents=True)
    (fs / "cgroup.controllers").write_text("cpu io pids\n")
    place = find_place(7, proc, fs)
    assert not place.writable and place.why_not == "cgroup v2 without the memory controller"
    (fs / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert find_place(7, proc, fs).writable and find_place(7, proc, fs).version == CgroupVersion.V2


def test_no_place_says_why(tmp_path):
    proc, fs = fake_v1(tmp_path)
    (fs / "memory" / "process_api" / "abc").rmdir()
    assert "does not exist" in find_place(42, proc, fs).why_not
    assert "cannot read" in find_place(99, proc, fs).why_not
    with pytest.raises(ValueError, match="not writable: .*does not exist.*watcher alone"):
        ReplicaCgroup(find_place(42, proc, fs), "x")


def test_v1_writer_joins_sets_and_moves_the_limit(tmp_path):
    proc, fs = fake_v1(tmp_path)
    cg = ReplicaCgroup(find_place(42, proc, fs), "gpubroker-hog-42")
    cg.create()
    (cg.path / "memory.usage_in_bytes").write_text(str(3 * MiB))  # what the kernel would show
    cg.join(42)
    assert (cg.path / "cgroup.procs").read_text() == "42" and cg.joined_usage_bytes == 3 * MiB
    limit = cg.limit_for(256 * MiB, 64 * MiB)
    assert limit == 3 * MiB + 256 * MiB + 64 * MiB + CGROUP_MARGIN_BYTES
    assert cg.set_limit(limit) == "" and cg.read_limit() == limit
    assert cg.set_limit(cg.limit_for(128 * MiB, 64 * MiB)) == "" and cg.limit_bytes < limit  # a grant moved down
    (cg.path / "memory.limit_in_bytes").unlink()
    (cg.path / "memory.limit_in_bytes").mkdir()  # a write that fails: the error names the file
    assert "memory.limit_in_bytes <- " in cg.set_limit(1)


def test_v2_writer_uses_memory_max(tmp_path):
    proc, fs = tmp_path / "proc", tmp_path / "cg"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/app\n")
    (fs / "app").mkdir(parents=True)
    (fs / "cgroup.controllers").write_text("memory\n")
    cg = ReplicaCgroup(find_place(7, proc, fs), "r")
    with pytest.raises(OSError, match="memory.max missing"):
        cg.create()  # a parent that does not delegate the memory controller
    (cg.path / "memory.max").write_text("max\n")
    cg.create()
    assert cg.read_limit() is None
    assert cg.set_limit(100 * MiB) == "" and (cg.path / "memory.max").read_text() == str(100 * MiB)


REAL = find_place()


@pytest.mark.skipif(
    not (REAL.writable and REAL.version == CgroupVersion.V1), reason=f"no writable v1 memory cgroup: {REAL.why_not}"
)
def test_a_real_v1_cgroup_limits_a_process_and_is_removed():
    """A real child in a real cgroup with a 64 MiB limit over its charge at join: it is killed
    when it touches 256 MiB (the kernel's answer past a cgroup limit); the cgroup is removed after."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); b = bytearray(256 * 2**20); print('survived')"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    cg = ReplicaCgroup(REAL, f"gpubroker-test-{os.getpid()}")
    try:
        cg.create()
        cg.join(child.pid)
        assert f"memory:{str(cg.path).split('/memory', 1)[1]}" in Path(f"/proc/{child.pid}/cgroup").read_text()
        assert cg.set_limit(cg.joined_usage_bytes + 64 * MiB) == ""
        assert cg.read_limit() == cg.joined_usage_bytes + 64 * MiB
        out, _ = child.communicate("go\n", timeout=60)
        assert child.returncode == -9 and "survived" not in out
    finally:
        child.kill()
        child.wait()
        assert cg.remove() == ""
    assert not cg.path.exists()
