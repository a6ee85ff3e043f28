"""A local Ray head for the fleet: ``ray start --head`` in its own process group, stopped by group.

``start_local_ray`` binds 127.0.0.1 with every port picked free and returns the group id;
``stop_local_ray(pgid)`` stops exactly that cluster (SIGTERM, then SIGKILL), so a fleet
outlives the CLI that started it and ``gpubroker down`` leaves every other Ray alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpubroker.deployments.cluster.ray_auth import ensure_token_auth, join_hint
from gpubroker.deployments.serve.failures import latest_session


class FleetError(RuntimeError):
    """Something the user must fix (a failed ``ray start``, a busy port, no fleet running); the CLI
    prints it without a traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are picked (``free_port``
    called n times can hand out one port twice: `ray start` then refuses two components on it)."""
    socks: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
            p = s.getsockname()[1]
            if p not in avoid and p not in ports:
                ports.append(p)
        return ports
    finally:
        for s in socks:
            s.close()


RAY_DASHBOARD_PORT = 8265


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR, as Serve's proxy (uvicorn)
    binds: a connection of the last fleet still in TIME-WAIT does not hold the port, a listener does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def start_local_ray(
    num_cpus: int | None = None, port: int | None = None, direct_ingress: bool = False
) -> dict[str, Any]:
    """``ray start --head`` on 127.0.0.1 in a new process group; every port picked free.
    ``direct_ingress``: Serve's direct ingress on (``gpubroker.deployments.serve.direct_ingress.DIRECT_ENV``).

    Returns ``{"address", "pgid", "dashboard", "auth_mode", "join"}`` (``join``: how another node
    joins); ``stop_local_ray(pgid)`` stops exactly it. Token auth is on unless RAY_AUTH_MODE says otherwise.
    """
    port = port if port and port_free(port) else free_port()
    dash, client_port, agent_port = free_ports(3, avoid=(port, RAY_DASHBOARD_PORT))
    if port_free(RAY_DASHBOARD_PORT) and port != RAY_DASHBOARD_PORT:
        dash = RAY_DASHBOARD_PORT  # Ray's own default, where `ray` and `serve status` look first
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin) if ray_bin.exists() else "ray",
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        str(port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dash),
        "--ray-client-server-port",
        str(client_port),
        "--dashboard-agent-listen-port",
        str(agent_port),
        "--num-cpus",
        str(num_cpus or max(2, os.cpu_count() or 2)),
        "--disable-usage-stats",
    ]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    # Token auth on unless the user chose a mode: their token, or a new one in Ray's token file
    # (gpubroker.deployments.cluster.ray_auth); this process and the head agree on it.
    auth = ensure_token_auth(env)
    from gpubroker.deployments.serve.http_proxy import PROXY_ENV  # the proxy answers a lost replica with a JSON 503

    for key, value in PROXY_ENV.items():
        env.setdefault(key, value)
    if direct_ingress:
        from gpubroker.deployments.serve.direct_ingress import DIRECT_ENV

        for key, value in DIRECT_ENV.items():
            env.setdefault(key, value)
    proc = subprocess.run(cmd, capture_output=True, text=True, start_new_session=True, env=env)
    if proc.returncode != 0:
        raise FleetError(f"`ray start --head` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    # start_new_session: the CLI process was the group leader; its daemons keep its pgid.
    pgid = pgid_of_gcs(port)
    address = f"127.0.0.1:{port}"
    return {
        "address": address,
        "pgid": pgid,
        "dashboard": f"http://127.0.0.1:{dash}",
        "session_dir": str(latest_session()),  # its logs (gpubroker logs), read before another Ray starts
        "auth_mode": auth.mode,
        "join": join_hint(address, auth),
    }


def pgid_of_gcs(port: int) -> int | None:
    # -ww: without it ps cuts args at the terminal width (80 when piped), before the port flag
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,pgid=,args="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and "gcs_server" in parts[2] and f"--gcs_server_port={port}" in parts[2]:
            return int(parts[1])
    return None


def stop_local_ray(pgid: int | None, timeout_s: float = 10.0) -> bool:
    """Stop the Ray cluster ``start_local_ray`` started: SIGTERM its process group, then SIGKILL."""
    if not pgid or pgid <= 1 or pgid == os.getpgid(0):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        time.sleep(0.5)
        if not _live_members(pgid):
            return True
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _live_members(pgid: int) -> int:
    """Processes of the group that are not zombies (exited daemons wait for init to reap them)."""
    out = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout
    return sum(
        1
        for line in out.splitlines()
        if len(line.split()) == 2 and line.split()[0] == str(pgid) and not line.split()[1].startswith("Z")
    )
