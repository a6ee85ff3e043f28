"""Parsing of a quota ledger checkpoint (the dict ``QuotaLedger.to_dict`` writes). Stdlib only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quotas.ledger_base import (
    LedgerError,
    ModelQuota,
    as_bytes,
    as_time,
    validate_quotas,
)
from quotas.transfers import Transfer


def parse_checkpoint(
    d: Mapping[str, Any], version: int
) -> tuple[int, dict[str, ModelQuota], dict[str, int], tuple[Transfer, ...], int]:
    """(usable, quotas, grants, pending, next_id) of a checkpoint; raises ``LedgerError`` naming the bad part."""
    if not isinstance(d, Mapping):
        raise LedgerError(f"checkpoint is {type(d).__name__}; pass the dict that QuotaLedger.to_dict() wrote")
    missing = [k for k in ("version", "usable_bytes", "quotas", "grants", "pending", "next_id") if k not in d]
    if missing:
        raise LedgerError(f"checkpoint lacks {', '.join(missing)}; pass the dict that QuotaLedger.to_dict() wrote")
    if d["version"] != version:
        raise LedgerError(
            f"checkpoint version {d['version']!r} is not {version}; start from the config "
            "(QuotaLedger.from_config) instead of this checkpoint"
        )
    usable = as_bytes(d["usable_bytes"], "usable_bytes")
    quotas: dict[str, ModelQuota] = {}
    if not isinstance(d["quotas"], Mapping):
        raise LedgerError("checkpoint quotas is not a mapping; pass the dict that QuotaLedger.to_dict() wrote")
    for name, q in d["quotas"].items():
        try:
            quotas[name] = ModelQuota(q["min_bytes"], q["base_bytes"], q["max_bytes"])
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"checkpoint quota for '{name}' is malformed ({exc}); it needs min_bytes, base_bytes, max_bytes",
                name,
            ) from None
        except LedgerError as exc:
            raise LedgerError(f"checkpoint quota for '{name}': {exc}", name) from None
    quotas = validate_quotas(quotas)
    if not isinstance(d["grants"], Mapping):
        raise LedgerError("checkpoint grants is not a mapping; pass the dict that QuotaLedger.to_dict() wrote")
    grants = {name: as_bytes(g, "grant", name) for name, g in d["grants"].items()}
    pending = []
    for raw in d["pending"]:
        try:
            pending.append(
                Transfer(
                    id=as_bytes(raw["id"], "transfer id"),
                    donor=str(raw["donor"]),
                    recipient=str(raw["recipient"]),
                    amount_bytes=as_bytes(raw["amount_bytes"], "amount_bytes", str(raw["donor"])),
                    kind=str(raw["kind"]),
                    started_s=as_time(raw["started_s"], "started_s"),
                )
            )
        except (KeyError, TypeError) as exc:
            raise LedgerError(
                f"checkpoint transfer {raw!r} is malformed ({exc}); each needs id, donor, recipient, "
                "amount_bytes, kind, started_s"
            ) from None
    return usable, quotas, grants, tuple(pending), as_bytes(d["next_id"], "next_id")
