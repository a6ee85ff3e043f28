"""What a live ``apply`` may change, and what needs a redeploy: pure checks on two configs."""

from __future__ import annotations

from collections.abc import Mapping

from gpubroker.quotas.config import FleetConfig
from gpubroker.quotas.sizes import format_size

# Fields whose change needs new deployments (`gpubroker up`), not a live `apply`.
_REDEPLOY_FIELDS = ("model", "options", "replicas")
# Fields read by replicas/ingress at deploy time: accepted, but take effect on the next `up`.
_NEXT_UP_FIELDS = ("max_queued", "request_timeout_s", "max_body_bytes")


def redeploy_issues(old: FleetConfig, cfg: FleetConfig) -> list[str]:
    """What in ``cfg`` a live ``apply`` cannot change (each names the field and the fix)."""
    issues = []
    added, removed = sorted(set(cfg.models) - set(old.models)), sorted(set(old.models) - set(cfg.models))
    if added or removed:
        parts = ([f"adds {', '.join(added)}"] if added else []) + ([f"removes {', '.join(removed)}"] if removed else [])
        issues.append(
            f"models: the new config {' and '.join(parts)}; models are Serve deployments, so changing the set "
            "needs `gpubroker down` then `gpubroker up NEW_CONFIG` (apply only changes quotas, batching and control)"
        )
    for name in sorted(set(cfg.models) & set(old.models)):
        for field_name in _REDEPLOY_FIELDS:
            a, b = getattr(old.models[name], field_name), getattr(cfg.models[name], field_name)
            if a != b:
                issues.append(
                    f"models.{name}.{field_name}: {a!r} -> {b!r} needs a redeploy; use `gpubroker up` "
                    "(apply only changes quotas, batching and control)"
                )
    for field_name in ("name", "namespace"):
        a, b = getattr(old.broker, field_name), getattr(cfg.broker, field_name)
        if a != b:
            issues.append(
                f"broker.{field_name}: {a!r} -> {b!r} would orphan the running broker; use `gpubroker down` then `up`"
            )
    if cfg.gpu.device != old.gpu.device:
        issues.append(f"gpu.device: {old.gpu.device!r} -> {cfg.gpu.device!r} needs a redeploy; use `gpubroker up`")
    return issues


def weights_issues(cfg: FleetConfig, memory_models: Mapping[str, tuple[int, float]]) -> list[str]:
    """A quota.min under the calibrated weights of the model's replicas could never hold the model."""
    issues = []
    for name, spec in cfg.models.items():
        calibrated = memory_models.get(name)
        if calibrated is None:
            continue
        need = int(calibrated[0]) * spec.replicas
        if spec.quota.min < need:
            issues.append(
                f"models.{name}.quota.min ({format_size(spec.quota.min)}) is under the model's calibrated weights "
                f"({format_size(need)} for {spec.replicas} replica(s)); raise quota.min to at least {format_size(need)}"
            )
    return issues


def next_up_notes(old: FleetConfig, cfg: FleetConfig) -> list[str]:
    """Fields ``apply`` accepts that only take effect on the next ``gpubroker up``."""
    notes = []
    for name in cfg.models:
        for field_name in _NEXT_UP_FIELDS:
            if getattr(cfg.models[name], field_name) != getattr(old.models[name], field_name):
                notes.append(f"models.{name}.{field_name} takes effect on the next `gpubroker up`")
        if cfg.models[name].batch.max_concurrent_batches != old.models[name].batch.max_concurrent_batches:
            notes.append(f"models.{name}.batch.max_concurrent_batches takes effect on the next `gpubroker up`")
    for field_name in ("http_host", "http_port", "direct_ingress", "proxy_timeout_s"):  # how Ray and Serve were started
        if getattr(cfg.broker, field_name) != getattr(old.broker, field_name):
            notes.append(f"broker.{field_name} takes effect on the next `gpubroker up`")
    return notes
