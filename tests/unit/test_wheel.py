"""The wheel installs one import name, ``gpubroker``: a Ray Serve project keeps its own ``deployments``
and ``broker`` packages beside it.

Builds the wheel from this checkout (setuptools follows the links gpubroker/{broker,deployments,quotas}
into real folders), installs it without dependencies into a folder of its own, and imports both the
user's packages and ours from a user project outside the clone, in a fresh interpreter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, deployments, broker, gpubroker
from gpubroker.deployments.app import build_app
from gpubroker.broker.core import BrokerCore
from gpubroker.quotas.config import FleetConfig
print(json.dumps({"deployments": deployments.__file__, "broker": broker.__file__, "gpubroker": gpubroker.__file__,
                  "ours": [build_app.__module__, BrokerCore.__module__, FleetConfig.__module__],
                  "user": [deployments.WHO, broker.WHO]}))
"""


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from, copied (links kept as links): an in-tree build would leave build/ in the
    clone, whose stale copies of removed modules a later build would ship."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("gpubroker", "broker", "deployments", "quotas", "configs"):  # gpubroker/demo links into configs/
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=skip)
    return dest


def _build_wheel(out: Path) -> Path:
    src = _source_copy(out.parent / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("gpubroker-*.whl")
    return wheel


def _user_project(root: Path) -> Path:
    for name in ("deployments", "broker"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"WHO = 'user {name}'\n")
    return root


def test_the_wheel_installs_only_gpubroker_beside_a_users_deployments_and_broker(tmp_path):
    wheel = _build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        names = set(z.namelist())
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gpubroker"}, tops
    assert {"gpubroker/broker/core.py", "gpubroker/deployments/app.py", "gpubroker/quotas/config.py"} <= names
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    project = _user_project(tmp_path / "acme-serving")
    # -P: no script directory or cwd magic beyond what PYTHONPATH says; the project first, as a user's would be.
    env = {"PYTHONPATH": f"{project}:{site}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-P", "-c", PROBE], cwd=project, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["user"] == ["user deployments", "user broker"]
    assert Path(seen["deployments"]).parent == project / "deployments"
    assert Path(seen["gpubroker"]).parent == site / "gpubroker"
    assert seen["ours"] == ["gpubroker.deployments.app", "gpubroker.broker.core", "gpubroker.quotas.config"]
