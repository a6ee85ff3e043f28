"""The quota ledger's invariants I1-I4 (``quotas.ledger`` docstring) as a list of problems.

``ledger_problems(ledger)`` is what ``QuotaLedger.problems`` returns: every broken invariant,
each message naming the model, the bytes and the fix. Stdlib only.
"""

from __future__ import annotations

from typing import Any

from quotas.ledger_base import FREE_POOL, fmt
from quotas.transfers import MODEL_TRANSFER_KINDS, TRANSFER_KINDS

# ``ledger`` below is a ``quotas.ledger.QuotaLedger`` (not imported: it imports this module)


def _transfer_problems(ledger: Any) -> list[str]:
    out: list[str] = []
    known = ledger._quotas
    for t in ledger._pending.values():
        if t.donor not in known:
            out.append(f"transfer {t.id} names unknown donor '{t.donor}'; abort it or add the model")
        if t.kind == "release":
            if t.recipient != FREE_POOL:
                out.append(
                    f"release transfer {t.id} from '{t.donor}' names recipient '{t.recipient}'; releases go to the pool ('')"
                )
        elif t.recipient not in known:
            out.append(f"transfer {t.id} names unknown recipient '{t.recipient}'; abort it or add the model")
        if t.donor == t.recipient:
            out.append(f"transfer {t.id} moves {fmt(t.amount_bytes)} from '{t.donor}' to itself; abort it")
        if t.amount_bytes <= 0:
            out.append(f"transfer {t.id} from '{t.donor}' has amount {fmt(t.amount_bytes)}; amounts must be > 0")
        if t.kind not in TRANSFER_KINDS:
            out.append(f"transfer {t.id} from '{t.donor}' has kind {t.kind!r}; use 'lend', 'reclaim' or 'release'")
        elif t.kind in MODEL_TRANSFER_KINDS and t.recipient == FREE_POOL:
            out.append(f"{t.kind} transfer {t.id} from '{t.donor}' names the pool as recipient; use kind 'release'")
        if t.id >= ledger._next_id:
            out.append(f"transfer {t.id} from '{t.donor}' is not below the next id {ledger._next_id}; raise next_id")
    return out


def ledger_problems(ledger: Any) -> list[str]:
    """Every broken invariant of ``ledger``."""
    quotas, grants = ledger._quotas, ledger._grants
    pending = ledger._pending.values()
    out = [f"transfer id {i} appears twice; checkpoints must list each pending transfer once" for i in ledger._dupe_ids]
    usable = ledger.usable_bytes
    for name in quotas:
        if name not in grants:
            out.append(f"'{name}' has a quota but no grant; give it a grant (its base {fmt(quotas[name].base_bytes)})")
    for name in grants:
        if name not in quotas:
            out.append(f"'{name}' has a grant but no quota; drop its grant or add its quota")
    out.extend(_transfer_problems(ledger))
    incoming: dict[str, int] = {}
    outgoing: dict[str, int] = {}
    for t in pending:
        if t.recipient != FREE_POOL:
            incoming[t.recipient] = incoming.get(t.recipient, 0) + t.amount_bytes
        if t.kind != "release":  # a release never comes back (the broker escalates, not aborts)
            outgoing[t.donor] = outgoing.get(t.donor, 0) + t.amount_bytes
    in_flight = sum(t.amount_bytes for t in pending)
    granted = sum(grants.values())
    if granted + in_flight > usable:
        out.append(
            f"sum of grants {fmt(granted)} + in flight {fmt(in_flight)} = {fmt(granted + in_flight)} exceeds "
            f"usable {fmt(usable)} by {fmt(granted + in_flight - usable)}; lower some grants or abort transfers"
        )
    total_base = sum(q.base_bytes for q in quotas.values())
    if total_base > usable:
        out.append(
            f"sum of base quotas {fmt(total_base)} exceeds usable {fmt(usable)}, so not every owner can reclaim "
            "its base; lower some models' quota.base or raise gpu.capacity"
        )
    for name, q in quotas.items():
        grant = grants.get(name)
        if grant is None:
            continue
        if grant < q.min_bytes:
            out.append(
                f"'{name}': grant {fmt(grant)} is under its min {fmt(q.min_bytes)}; raise it by "
                f"{fmt(q.min_bytes - grant)} or lower models.{name}.quota.min"
            )
        moving = incoming.get(name, 0) + outgoing.get(name, 0)
        ceiling = grant + moving
        if ceiling > q.max_bytes:
            out.append(
                f"'{name}': grant {fmt(grant)} + in flight to/from it {fmt(moving)} = {fmt(ceiling)} exceeds its max "
                f"{fmt(q.max_bytes)}; lower it by {fmt(ceiling - q.max_bytes)} or raise models.{name}.quota.max"
            )
    return out
