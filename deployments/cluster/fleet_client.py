"""Talking to a running fleet: the state file ``up`` writes, connecting to its Ray, the broker's API.

The state file (``~/.gpubroker/fleet.json``, or ``$GPUBROKER_STATE_DIR``) records what
``gpubroker.deployments.cluster.fleet.up_fleet`` started; every other command reads it to find the fleet. Reads
from the broker go over HTTP (``/v1/status``, ``/v1/decisions``) when they can and through Ray
otherwise. Ray and httpx are imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

from gpubroker.broker.client import BrokerClient, blocking
from gpubroker.broker.wire import ApplyResult, BrokerStatus, DecisionRecord
from gpubroker.deployments.cluster.local_ray import FleetError
from gpubroker.deployments.cluster.ray_auth import adopt_auth_mode

APP_NAME = "gpubroker"


# =============================================================================== state file
def state_dir() -> Path:
    return Path(os.environ.get("GPUBROKER_STATE_DIR") or Path.home() / ".gpubroker")


def state_path() -> Path:
    return state_dir() / "fleet.json"


def read_state() -> dict[str, Any] | None:
    try:
        return json.loads(state_path().read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def clear_state() -> None:
    try:
        state_path().unlink()
    except FileNotFoundError:
        pass


# =============================================================================== Ray
def connect(address: str | None, runtime_env: dict[str, Any] | None = None) -> None:
    """ray.init to a running cluster, quietly; ``runtime_env``: the job's (Serve gives it to
    every deployment: ``gpubroker.deployments.cluster.user_code`` ships the user's packages with it)."""
    import ray

    if ray.is_initialized():
        return
    state = read_state()
    if state and state.get("started_ray") and address == state.get("address"):
        adopt_auth_mode(state.get("auth_mode") or "token")  # as start_local_ray started it
    try:
        ray.init(
            address=address or "auto",
            logging_level="ERROR",  # type: ignore[arg-type]  # ray.init takes a level name too
            log_to_driver=False,
            namespace=APP_NAME,
            runtime_env=runtime_env,
        )
    except Exception as exc:  # noqa: BLE001
        raise FleetError(
            f"cannot connect to Ray at {address or 'auto'} ({exc}); is a fleet running? start one with `gpubroker up`"
        ) from None


def resolve_address(address: str | None) -> str | None:
    if address:
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    state = read_state()
    return state.get("address") if state else None


# =============================================================================== broker access
def http_get(path: str, timeout_s: float = 5.0) -> Any | None:
    """GET the broker's HTTP API at the recorded fleet's URL; None without a fleet, on error or non-200."""
    state = read_state()
    if not state or not state.get("http_url"):
        return None
    import httpx

    try:
        r = httpx.get(state["http_url"] + path, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def broker_client(address: str | None, timeout_s: float = 30.0) -> BrokerClient:
    """The running broker actor (connecting to Ray first), called through a typed client; FleetError
    names how to start one."""
    import ray

    addr = resolve_address(address)
    if addr is None:
        raise FleetError(
            "no fleet is running (no state file, no --address, no RAY_ADDRESS); start one with `gpubroker up`"
        )
    connect(addr)
    state = read_state() or {}
    name, ns = state.get("broker_name", "gpubroker"), state.get("broker_namespace", "gpubroker")
    try:
        return BrokerClient(ray.get_actor(name, namespace=ns), timeout_s)
    except ValueError:
        raise FleetError(
            f"no broker '{name}' in namespace '{ns}' at {addr}; start the fleet with `gpubroker up`"
        ) from None


def fetch_status(address: str | None) -> BrokerStatus:
    """The broker's status over HTTP, else through Ray; raises (FleetError, Ray errors) instead of exiting."""
    st = None if address else http_get("/v1/status")
    if st is None:
        return blocking(broker_client(address).status())
    return cast(BrokerStatus, st)  # the fleet API answers the broker's status as it is


def fetch_decisions(address: str | None, model: str | None, since_seq: int) -> list[DecisionRecord]:
    """Decision-log entries after ``since_seq`` (one model's, or all), over HTTP, else through Ray."""
    query = f"/v1/decisions?since_seq={since_seq}" + (f"&model={model}" if model else "")
    out = None if address else http_get(query)
    if out is None:
        return blocking(broker_client(address).decisions(model, since_seq))
    return cast(list[DecisionRecord], out)  # the fleet API answers the broker's entries as they are


def apply_config(address: str | None, text: str, source: str) -> ApplyResult:
    """Swap the running broker's config; on success the state file records it. Returns the broker's answer."""
    result = blocking(broker_client(address, timeout_s=60.0).apply(text))
    if result["ok"]:
        state = read_state()
        if state:
            state.update(config=source, config_text=text, config_hash=result["config_hash"])
            write_state(state)
    return result
