"""A user's own package, run as a user runs it: ``gpubroker up`` as a subprocess from their project
directory (a tmp dir holding ``acme/models.py``), real Ray Serve on CPU, real HTTP.

``acme.models`` holds what ordinary PyTorch code looks like: numpy outputs (a float32 score, an
array, an int64 label), an ``async def predict``, a torch module in an attribute called
``encoder`` returning tensors. Each answers over HTTP with JSON. ``up`` ships the package to the
replicas (``gpubroker.deployments.cluster.user_code``: Ray ``py_modules``, what a node without the project directory
imports; on the node ``up`` ran on, Ray also puts the driver's directory on the path). A model
that cannot be built stops ``up`` with a non-zero exit naming it, before any Ray starts.
``encoded`` comes up with the quota ``gpubroker calibrate`` printed for it (issue 54 item 5): the
suggestion holds what its replica process really holds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpubroker.deployments.cluster.local_ray import free_port
from gpubroker.quotas.sizes import parse_size

pytestmark = pytest.mark.integration

MODELS = '''
"""A user's models, written as ordinary PyTorch code."""
import asyncio

import numpy as np
import torch

from gpubroker import InputError, Model


class NumpyScorer(Model):
    def validate(self, item):
        if not isinstance(item.get("x"), (int, float)):
            raise InputError("x", "expected a number")
        return item

    def predict(self, items):
        return [
            {"score": np.float32(item["x"]) * 2, "vec": np.arange(3, dtype=np.float64), "label": np.int64(7)}
            for item in items
        ]

    def example_input(self, cost=None):
        return {"x": 1.5}


class AsyncEcho:
    async def predict(self, items):
        await asyncio.sleep(0)
        import sys

        shipped = [p for p in sys.path if "runtime_resources" in p]  # Ray's copies of py_modules
        return [(item["x"], "async", shipped) for item in items]

    def example_input(self, cost=None):
        return {"x": 2}


class Encoded:
    def __init__(self, width: int = 16):
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(width, 4)
        self.width = width

    def predict(self, items):
        with torch.no_grad():
            return list(self.encoder(torch.tensor([item["v"] for item in items], dtype=torch.float32)))

    def example_input(self, cost=None):
        return {"v": [0.5] * self.width}
'''

CONFIG = """
broker: {name: gpubroker-userpkg, namespace: gpubroker-userpkg, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, http_host: 127.0.0.1, http_port: PORT}
gpu: {device: cpu, capacity: 2GiB, reserve_frac: 0.0}
models:
  scorer:
    model: acme.models:NumpyScorer
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 8}
  echo:
    model: acme.models:AsyncEcho
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 8}
  encoded:
    model: acme.models:Encoded
    options: {width: 16}
    quota: {min: 64MiB, base: 256MiB, max: 256MiB}
    batch: {floor: 1, ceiling: 8}
"""


def gpubroker_cmd() -> list[str]:
    """The console script a user runs (beside this interpreter), else ``python -m gpubroker``."""
    script = Path(sys.executable).parent / "gpubroker"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpubroker"]


def run(project: Path, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*gpubroker_cmd(), *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("userproject")
    (root / "acme").mkdir()
    (root / "acme" / "__init__.py").write_text("")
    (root / "acme" / "models.py").write_text(MODELS)
    port = free_port()
    (root / "fleet.yaml").write_text(CONFIG.replace("PORT", str(port)))
    env = dict(os.environ, GPUBROKER_STATE_DIR=str(root / "state"), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)  # the package must come from the project directory, not the test's path
    suggested = quota_calibrate_suggests(root, env, "encoded")
    text = (root / "fleet.yaml").read_text()
    written = "options: {width: 16}\n    quota: {min: 64MiB, base: 256MiB, max: 256MiB}"
    assert written in text
    (root / "fleet.yaml").write_text(text.replace(written, f"options: {{width: 16}}\n    quota: {suggested['line']}"))
    return {"root": root, "env": env, "url": f"http://127.0.0.1:{port}", "suggested": suggested}


def quota_calibrate_suggests(root: Path, env: dict, model: str) -> dict:
    """Run ``gpubroker calibrate fleet.yaml MODEL`` as a user does and read the quota it printed."""
    r = run(root, env, "calibrate", "fleet.yaml", model, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    found = re.search(r"quota: (\{min: (\S+), base: (\S+), max: (\S+)\})", r.stdout)
    assert found, r.stdout
    assert "Ray Serve's replica runtime" in r.stdout and "kept free" in r.stdout, r.stdout  # its parts, printed
    sizes = {k: parse_size(v) for k, v in zip(("min", "base", "max"), found.group(2, 3, 4))}
    return {"line": found.group(1), **sizes}


def test_up_from_the_project_directory_serves_the_users_models(project):
    root, env, url = project["root"], project["env"], project["url"]
    r = run(root, env, "up", "fleet.yaml", "--num-cpus", "2")
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fleet up" in r.stdout and "skipped" not in r.stdout, r.stdout
        assert f"shipped to the replicas: {root / 'acme'}" in r.stdout, r.stdout
        with httpx.Client(timeout=60) as client:
            scorer = client.post(f"{url}/v1/models/scorer/infer", json={"inputs": [{"x": 1.5}, {"x": -1}]})
            assert scorer.status_code == 200, scorer.text
            assert scorer.json()["outputs"] == [
                {"score": 3.0, "vec": [0.0, 1.0, 2.0], "label": 7},
                {"score": -2.0, "vec": [0.0, 1.0, 2.0], "label": 7},
            ]
            refused = client.post(f"{url}/v1/models/scorer/infer", json={"input": {"x": "one"}})
            assert refused.status_code == 422 and refused.json()["field"] == "input.x", refused.text
            echo = client.post(f"{url}/v1/models/echo/infer", json={"input": {"x": 4}})
            assert echo.status_code == 200 and echo.json()["output"][:2] == [4, "async"], echo.text
            shipped = echo.json()["output"][2]  # the copy Ray unpacked for the replica (a node without the project dir)
            assert any("py_modules" in p for p in shipped), shipped
            enc = client.post(f"{url}/v1/models/encoded/infer", json={"inputs": [{"v": [0.5] * 16}] * 3})
            assert enc.status_code == 200, enc.text
            rows = enc.json()["outputs"]
            # the same input in any batch: equal within float tolerance (DESIGN.md: a batch of 1 and
            # one of 2 take different kernels; the three items may run as [0] and [1, 2])
            assert len(rows) == 3 and all(row == pytest.approx(rows[0], rel=1e-5) for row in rows), rows
            for _ in range(20):  # it keeps serving at the calibrated quota, batches of 1-8
                more = client.post(f"{url}/v1/models/encoded/infer", json={"inputs": [{"v": [0.5] * 16}] * 8})
                assert more.status_code == 200, more.text
        st = run(root, env, "status", "--json", timeout=120)
        assert st.returncode == 0, st.stdout + st.stderr
        models = json.loads(st.stdout)["models"]
        assert set(models) == {"scorer", "echo", "encoded"}
        encoded, suggested = models["encoded"], project["suggested"]
        assert suggested["min"] <= encoded["grant_bytes"] <= suggested["max"], (encoded, suggested)
        # what its replica process holds fits the grant, with the share its fast loop keeps free
        assert 0 < encoded["used_bytes"] <= 0.9 * encoded["grant_bytes"], (encoded, suggested)
    finally:
        down = run(root, env, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_model_that_cannot_be_built_stops_up_naming_it(project):
    root, env = project["root"], project["env"]
    bad = root / "bad.yaml"
    bad.write_text((root / "fleet.yaml").read_text().replace("options: {width: 16}", "options: {width: 16, depth: 3}"))
    r = run(root, env, "up", "bad.yaml", "--num-cpus", "2", timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "model 'encoded'" in out and "depth" in out and "fleet up" not in out, out
    assert not (Path(env["GPUBROKER_STATE_DIR"]) / "fleet.json").exists()  # stopped before any Ray started


def test_a_project_with_its_own_deployments_and_broker_packages_serves_from_them(tmp_path):
    """A Ray Serve project often has its own ``deployments/`` (and ``broker/``): gpubroker installs one
    import name, ``gpubroker``, so a model path into the user's ``deployments`` imports the user's
    package, which is shipped to the replicas like any other, and serves."""
    for pkg in ("deployments", "broker"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(f"WHO = 'user {pkg}'\n")
    (tmp_path / "deployments" / "scorer.py").write_text(MODELS)
    port = free_port()
    (tmp_path / "fleet.yaml").write_text(
        CONFIG.replace("PORT", str(port)).replace("acme.models:", "deployments.scorer:")
    )
    env = dict(os.environ, GPUBROKER_STATE_DIR=str(tmp_path / "state"), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONPATH", None)
    r = run(tmp_path, env, "up", "fleet.yaml", "--num-cpus", "2", timeout=300)
    try:
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert f"shipped to the replicas: {tmp_path / 'deployments'}" in r.stdout, r.stdout
        with httpx.Client(timeout=60) as client:
            scorer = client.post(f"http://127.0.0.1:{port}/v1/models/scorer/infer", json={"input": {"x": 1.5}})
        assert scorer.status_code == 200 and scorer.json()["output"]["score"] == 3.0, scorer.text
    finally:
        down = run(tmp_path, env, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr


SLOW = """
import time


class Slow:
    def predict(self, items):
        time.sleep(3.0)  # longer than its request_timeout_s: every request answers 504
        return [1 for _ in items]

    def example_input(self, cost=None):
        return {}
"""


def test_a_model_whose_first_requests_keep_failing_stops_up_within_wait(project):
    """``--wait 5``: the model's first requests answer 504 (over its request_timeout_s) for 5 s;
    ``up`` exits non-zero with the model's name, its last answer and what to do."""
    root, env = project["root"], project["env"]
    (root / "acme" / "slow.py").write_text(SLOW)
    (root / "slow.yaml").write_text(
        (root / "fleet.yaml").read_text().split("models:")[0]
        + "models:\n  slow:\n    model: acme.slow:Slow\n    request_timeout_s: 1\n"
        + "    quota: {min: 64MiB, base: 256MiB, max: 256MiB}\n    batch: {floor: 1, ceiling: 8}\n"
    )
    r = run(root, env, "up", "slow.yaml", "--num-cpus", "2", "--wait", "5", timeout=600)
    try:
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode != 0, out
        assert "model 'slow' did not answer its first request with 200 in 5s" in out, out
        assert "HTTP 504" in out and "request_timeout_s" in out and "--wait SECONDS" in out, out
        assert "fleet up" not in out
    finally:
        down = run(root, env, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
