"""`gpubroker up | status | apply | decisions | down` as a user runs them (subprocesses, own Ray head)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gpubroker.deployments.cluster.local_ray import free_port

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def gpubroker(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpubroker", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    port = free_port()
    cfg = tmp / "fleet.yaml"
    cfg.write_text((HERE / "cli.yaml").read_text().replace("http_port: 8000", f"http_port: {port}"))
    env = dict(os.environ, GPUBROKER_STATE_DIR=str(tmp / "state"), RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1")
    env.pop("RAY_ADDRESS", None)
    return {"env": env, "config": cfg, "port": port, "tmp": tmp}


def test_commands_without_a_fleet(cli_env):
    for cmd in (["status"], ["decisions"], ["down"]):
        r = gpubroker(*cmd, env=cli_env["env"], timeout=60)
        assert r.returncode == 1 and "no fleet is running" in r.stderr, (cmd, r.stdout, r.stderr)


def test_up_status_apply_decisions_down(cli_env):
    env, cfg = cli_env["env"], cli_env["config"]
    r = gpubroker("up", str(cfg), "--num-cpus", "2", env=env)
    gcs_port = (
        json.loads((Path(env["GPUBROKER_STATE_DIR"]) / "fleet.json").read_text())["address"].rsplit(":", 1)[-1]
        if (Path(env["GPUBROKER_STATE_DIR"]) / "fleet.json").exists()
        else None
    )
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "fleet up" in r.stdout
        url = f"http://127.0.0.1:{cli_env['port']}"
        assert (
            httpx.post(f"{url}/v1/models/mlp/infer", json={"input": {"x": [0.0] * 64}}, timeout=30).status_code == 200
        )

        r = gpubroker("status", env=env, timeout=60)
        assert r.returncode == 0 and "mlp" in r.stdout and "emu" in r.stdout, r.stdout + r.stderr
        r = gpubroker("status", "--json", env=env, timeout=60)
        st = json.loads(r.stdout)
        assert set(st["models"]) == {"mlp", "emu"}
        hash0 = st["config_hash"]

        bad = cli_env["tmp"] / "bad.yaml"
        bad.write_text(cfg.read_text().replace("base: 256MiB, max: 512MiB", "base: 900MiB, max: 512MiB"))
        r = gpubroker("apply", str(bad), env=env, timeout=60)
        assert r.returncode == 1 and "emu.quota" in r.stderr, r.stdout + r.stderr
        renamed = cli_env["tmp"] / "renamed.yaml"
        renamed.write_text(cfg.read_text().replace("  emu:\n", "  emu2:\n"))
        r = gpubroker("apply", str(renamed), env=env, timeout=60)
        assert r.returncode == 1 and "gpubroker up" in r.stderr, r.stdout + r.stderr
        assert json.loads(gpubroker("status", "--json", env=env, timeout=60).stdout)["config_hash"] == hash0

        good = cli_env["tmp"] / "good.yaml"
        good.write_text(cfg.read_text().replace("ceiling: 32", "ceiling: 24"))
        r = gpubroker("apply", str(good), env=env, timeout=60)
        assert r.returncode == 0 and "applied" in r.stdout, r.stdout + r.stderr
        st = json.loads(gpubroker("status", "--json", env=env, timeout=60).stdout)
        assert st["config_hash"] != hash0 and st["models"]["emu"]["max_batch_size"] <= 24

        r = gpubroker("decisions", "--json", env=env, timeout=60)
        assert r.returncode == 0 and any(d["kind"] == "apply" for d in json.loads(r.stdout))
        r = gpubroker("decisions", "--model", "mlp", env=env, timeout=60)
        assert r.returncode == 0
    finally:
        r = gpubroker("down", env=env, timeout=120)
    assert r.returncode == 0 and "fleet down" in r.stdout, r.stdout + r.stderr
    assert not (Path(env["GPUBROKER_STATE_DIR"]) / "fleet.json").exists()
    # the Ray that `up` started is gone: no GCS process with its port is left behind
    import subprocess
    import time

    for _ in range(20):
        ps = subprocess.run(["ps", "-ww", "-eo", "args="], capture_output=True, text=True).stdout
        if f"--gcs_server_port={gcs_port}" not in ps:
            break
        time.sleep(0.5)
    assert gcs_port and f"--gcs_server_port={gcs_port}" not in ps, "gpubroker down left the local Ray running"
