"""Why a Serve deployment failed and where its replicas' logs are: what ``up``, ``apply`` and
``gpubroker logs`` show a user instead of Serve's bare "Failed to update the deployments [...]".

Serve keeps a failed deployment's cause (the replica constructor's traceback) in that deployment's
status message, not in its application's; the replicas' own output goes to
``<ray temp dir>/session_latest/logs/serve/replica_<app>_<deployment>_<id>.log`` on their node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FAILED = frozenset({"DEPLOY_FAILED", "UNHEALTHY"})
CAUSE_LINES = 6  # a traceback's last lines: the exception and the frames nearest it


def _state(status: Any) -> str:
    return status.value if hasattr(status, "value") else str(status)


def last_lines(text: str, n: int = CAUSE_LINES) -> str:
    """The last ``n`` non-blank lines of ``text``, joined by newlines."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def failure_cause(apps: Mapping[str, Any]) -> str:
    """Each failed deployment of ``apps`` (name -> Serve's ApplicationStatusOverview or None) with the
    last lines of its own message; an app that failed with no failed deployment gives its own message."""
    parts = []
    for app_name, app in apps.items():
        if app is None or _state(app.status) not in FAILED:
            continue
        failed = {n: d for n, d in app.deployments.items() if _state(d.status) in FAILED}
        for name, dep in failed.items():
            parts.append(f"{name} ({_state(dep.status)}):\n{last_lines(dep.message) or '(no message from Serve)'}")
        if not failed:
            parts.append(f"{app_name} ({_state(app.status)}): {last_lines(app.message) or '(no message from Serve)'}")
    return "\n".join(parts)


def latest_session() -> Path:
    """The Ray session this node started last (``session_latest`` resolved: read it right after a start,
    since another Ray started on this machine later moves the link)."""
    return (Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "session_latest").resolve()


def serve_log_dir(session_dir: str | None = None) -> Path:
    """The Serve log folder of a Ray session (the one ``up`` recorded, else the node's latest)."""
    return (Path(session_dir) if session_dir else latest_session()) / "logs" / "serve"


def replica_logs(app: str, model: str, log_dir: Path | None = None) -> list[Path]:
    """The log files of a model's replicas on this node (its own Serve app ``app``, or a deployment named
    after it in another app), newest first."""
    where = log_dir or serve_log_dir()
    if not where.is_dir():
        return []
    found = [p for p in where.glob("replica_*.log") if p.name.startswith(f"replica_{app}_") or f"_{model}_" in p.name]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def where_to_look(dashboard: str | None, log_dir: Path | None = None) -> str:
    """One line naming the replicas' logs, the logs command and the Ray dashboard."""
    where = log_dir or serve_log_dir()
    line = f"replica logs: {where} (`gpubroker logs MODEL`)"
    return line + (f"; Ray dashboard: {dashboard}" if dashboard else "")
