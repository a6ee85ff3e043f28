"""What models may hold, measured: the invariant ``sum of max(grant, measured use) <= usable``.

The ledger's own invariant (I1: grants + bytes in flight <= usable) is arithmetic; this one
adds what the replicas measured. A model may hold ``max(grant + outgoing, used)`` now: its
grant, plus bytes it has given up but not yet been measured to have freed (transfers and
releases in flight from it), or more if it measured more. The broker checks that the sum over
models stays within usable after every tick (``gpubroker.broker.core``), raises a grant from the pool
only into ``measured_free_bytes`` (``gpubroker.broker.control.lending``), and the tests check it at every step.

Pure: stdlib only; ``used_bytes`` maps model -> measured bytes (missing: nothing measured, 0).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpubroker.quotas.ledger import QuotaLedger, fmt


def held_bytes(ledger: QuotaLedger, used_bytes: Mapping[str, int]) -> dict[str, int]:
    """Per model: max(grant + bytes in flight from it, measured use)."""
    return {
        name: max(ledger.grant(name) + ledger.outgoing_bytes(name), int(used_bytes.get(name, 0)))
        for name in ledger.quotas
    }


def measured_free_bytes(ledger: QuotaLedger, used_bytes: Mapping[str, int]) -> int:
    """Usable minus what models may hold: what a grant may grow into without measuring anyone again."""
    return ledger.usable_bytes - sum(held_bytes(ledger, used_bytes).values())


def holding_problems(ledger: QuotaLedger, used_bytes: Mapping[str, int]) -> list[str]:
    """Empty when sum of max(grant + outgoing, used) <= usable; else one message naming the excess."""
    held = held_bytes(ledger, used_bytes)
    total = sum(held.values())
    if total <= ledger.usable_bytes:
        return []
    over = [
        f"{n} {fmt(h)} (grant {fmt(ledger.grant(n))}, used {fmt(int(used_bytes.get(n, 0)))})" for n, h in held.items()
    ]
    return [
        (
            f"models may hold {fmt(total)} ({', '.join(over)}), over usable {fmt(ledger.usable_bytes)} by "
            f"{fmt(total - ledger.usable_bytes)}; a grant was raised before the memory was measured free, or a model "
            "uses more than its grant (check its enforcement)"
        )
    ]
