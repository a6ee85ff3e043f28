"""A reliability fleet started the way an operator starts one: ``gpubroker up`` in a subprocess.

``up`` starts its own Ray head (its own process group, free ports, 127.0.0.1), the broker and
the Serve app, then exits: the test process is a second, later driver that connects to the
same cluster. ``down`` stops exactly that cluster. The CLI state file lives in a temporary
``GPUBROKER_STATE_DIR``; ``PYTHONPATH`` lets Ray workers import ``tests.chaos.counting``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos.harness import ROOT

FLEET_YAML = Path(__file__).with_name("fleet.yaml")
GPUBROKER = str(Path(sys.executable).with_name("gpubroker"))


@dataclass
class LiveFleet:
    text: str
    config_path: Path
    state_dir: Path
    count_dir: Path
    checkpoint: Path
    env: dict[str, str]
    state: dict[str, Any] = field(default_factory=dict)
    up_output: str = ""

    @property
    def url(self) -> str:
        return self.state["http_url"]

    def cli(self, *args: str, timeout_s: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [GPUBROKER, *args], capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout_s
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"gpubroker {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def broker(self):
        import ray

        return ray.get_actor("gpubroker-rel", namespace="gpubroker-rel")

    def status(self) -> dict:
        import ray

        return ray.get(self.broker().status.remote(), timeout=30)


def fleet_text(tmp: Path, http_port: int, metrics_port: int) -> str:
    text = FLEET_YAML.read_text()
    return (
        text.replace("METRICS_PORT", str(metrics_port))
        .replace("HTTP_PORT", str(http_port))
        .replace("CHECKPOINT", str(tmp / "broker.checkpoint.json"))
        .replace("COUNT_DIR", str(tmp / "counts"))
    )


def up(tmp: Path, timeout_s: float = 420) -> LiveFleet:
    from gpubroker.deployments.cluster.local_ray import free_port

    text = fleet_text(tmp, free_port(), free_port())
    cfg_path = tmp / "fleet.yaml"
    cfg_path.write_text(text)
    env = dict(
        os.environ,
        GPUBROKER_STATE_DIR=str(tmp / "state"),
        RAY_USAGE_STATS_ENABLED="0",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    env.pop("RAY_ADDRESS", None)
    fleet = LiveFleet(text, cfg_path, tmp / "state", tmp / "counts", tmp / "broker.checkpoint.json", env)
    proc = fleet.cli(
        "up", str(cfg_path), "--num-cpus", "2", "--ray-port", str(free_port()), "--timeout", "300", timeout_s=timeout_s
    )
    fleet.up_output = proc.stdout + proc.stderr
    state_file = fleet.state_dir / "fleet.json"
    if state_file.exists():
        fleet.state = json.loads(state_file.read_text())
    if proc.returncode != 0:
        down(fleet)
        raise AssertionError(f"gpubroker up failed ({proc.returncode}):\n{fleet.up_output[-4000:]}")
    return fleet


def connect(fleet: LiveFleet) -> None:
    import ray

    os.environ["PYTHONPATH"] = fleet.env["PYTHONPATH"]
    from gpubroker.deployments.cluster.ray_auth import adopt_auth_mode

    adopt_auth_mode(fleet.state.get("auth_mode") or "token")  # as `gpubroker up` started the head
    ray.init(
        address=fleet.state["address"], namespace="gpubroker-rel-tests", logging_level="ERROR", log_to_driver=False
    )


def down(fleet: LiveFleet) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    try:
        fleet.cli("down", timeout_s=120)
    except subprocess.TimeoutExpired:
        pass
    from gpubroker.deployments.cluster.local_ray import stop_local_ray

    if fleet.state.get("pgid"):
        stop_local_ray(fleet.state["pgid"])  # in case `down` could not
