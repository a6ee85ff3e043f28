"""Serve versions from what a deployment runs (``gpubroker.deployments.app``, ``gpubroker.deployments.llm.openai_api``,
``gpubroker.deployments.serve.reconcile``): redeploying an app whose deployment is unchanged leaves its replicas
running; one whose code, options or arguments changed restarts."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path


def code_digest(model_ref: str = "") -> str:
    """What the code a replica runs hashes to: every module of gpubroker's own packages and, for a
    user model (``pkg.module:Class``), its module's file, read where Python would import it from
    (not imported here). A redeploy after either changed is a new version: Serve restarts the
    replicas instead of leaving them on the old code."""
    from gpubroker.deployments.models import model_source

    h = hashlib.sha256(_own_code_digest().encode())
    h.update(model_ref.encode())
    source = model_source(model_ref)
    if source is not None:  # a module not found here: the replica reports it when it loads
        h.update(source)
    return h.hexdigest()[:16]


@functools.cache
def _own_code_digest() -> str:
    h = hashlib.sha256()
    root = (
        Path(__file__).resolve().parents[2]
    )  # deployments/serve/versions.py -> the folder holding broker/, deployments/, quotas/
    for pkg in ("broker", "deployments", "quotas"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def deployment_version(
    model_cls: type, dep_name: str, replicas: int, actor_options: dict, args: tuple, code: str = ""
) -> str:
    """A Serve version from what a deployment runs (class, name, replicas, Ray options, constructor
    arguments, ``code``: ``code_digest``). Redeploying an app whose group is unchanged is then a
    no-op for that group: its replicas keep running (``gpubroker.deployments.serve.reconcile``). Serve would
    otherwise give every ``serve.run`` a random version and restart every replica of the app."""
    digest = [hashlib.sha256(a.encode()).hexdigest() if isinstance(a, str) else a for a in args]
    blob = json.dumps(
        [f"{model_cls.__module__}.{model_cls.__qualname__}", dep_name, replicas, actor_options, digest, code],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
