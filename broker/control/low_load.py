"""The low-load wait: a batch wait that cannot gather a batch goes to its floor (``wait.min_ms``).

A wait buys something only through the requests that arrive during it: at ``lambda`` requests per
second per replica a wait of ``w`` gathers ``lambda * w`` of them on average if they come one by
one (Poisson), more if they come in clumps, and the window's batches show how many came together
(their mean size beyond one request), so the larger of the two counts. Where that is under one,
most waits close on the request that opened them (no arrival at all in ``e**-1`` or more of
them), and every request pays the whole wait: a model computing in 0.5 ms answers in
``wait.max_ms`` at 0.4 req/s. The same holds where the cap takes a single request (the batch is
full when it opens). So then the wait is the floor, unless the time batching saves is needed:
requests run one at a time must keep the replica under the plan's utilisation ceiling
(``RHO_MAX``), else a batch of one would queue (with eager formation the wait is what forms
batches under load), and the card must have time to spare: each batch pays the fixed cost on a
card its neighbours share, so where the card is busy (``GpuLoad.sm_util_frac``) the few requests
a wait merges save time a bursting neighbour needs (bench/notes/low-load-wait.md).

Hysteresis, in every measure: the floor is entered below ``ENTER_ARRIVALS`` expected arrivals
with the one-at-a-time utilisation and the card's busy share under ``1 / LEAVE_FACTOR`` of the
ceiling, and left only at ``LEAVE_FACTOR`` times any of them. A rate that wanders around one
boundary (report-to-report noise, a wait that moves with the rate) keeps the wait where it is
instead of flipping it between the floor and the plan every tick. Whether the wait is at the
floor now is the state it reads (an input). Pure.
"""

from __future__ import annotations

from typing import NamedTuple

ENTER_ARRIVALS = 1.0  # fewer requests than this expected during the wait: waiting forms no batch
LEAVE_FACTOR = 2.0  # the floor is left at this many times the load that enters it


class WaitGather(NamedTuple):
    """What a wait would gather on one replica, and what the load needs of it."""

    arrivals: float  # requests expected during the wait per replica: rate x wait, or what batches held beyond one
    cap_requests: float  # requests the cap takes (cap in batch units / units per request)
    solo_util: float | None  # busy share if every request ran alone, L(1 request) x rate (None: no fit)
    rho_max: float  # the plan's utilisation ceiling for the profile's objective
    card_util: float | None = None  # the card's busy share (SM utilisation; None: not measured)

    def floors(self, at_floor: bool) -> bool:
        """The wait goes (or stays) at the floor: it gathers nothing the load needs. ``at_floor``:
        it is there now (the hysteresis' state)."""
        if self.cap_requests < 2.0:
            return True
        utils = [u for u in (self.solo_util, self.card_util) if u is not None]
        if at_floor:  # leave only at LEAVE_FACTOR x the load that entered
            busy = any(u >= self.rho_max for u in utils)
            return not (self.arrivals >= ENTER_ARRIVALS * LEAVE_FACTOR or busy)
        light = all(u < self.rho_max / LEAVE_FACTOR for u in utils)
        return self.arrivals < ENTER_ARRIVALS and light

    def why(self, wait_s: float) -> str:
        """The reason's words: what the wait would gather, against the thresholds."""
        if self.cap_requests < 2.0:
            return f"cap takes {self.cap_requests:.1f} request: a batch is full when it opens"
        solo = "" if self.solo_util is None else f", one at a time {self.solo_util:.0%} busy"
        card = "" if self.card_util is None else f", card {self.card_util:.0%} busy"
        return (
            f"{self.arrivals:.2f} arrivals expected in a {wait_s * 1000:.1f} ms wait per replica "
            f"(floor under {ENTER_ARRIVALS:g}, left at {ENTER_ARRIVALS * LEAVE_FACTOR:g}){solo}{card}"
        )


def wait_gather(
    requests_per_s: float,
    wait_s: float,
    cap_requests: float,
    solo_ms: float | None,
    rho_max: float,
    card_util: float | None = None,
    seen_extra: float = 0.0,
) -> WaitGather:
    """``WaitGather`` for a replica taking ``requests_per_s`` with a wait of ``wait_s``; ``solo_ms``:
    the latency model's time for a batch of one request (None without a fit); ``card_util``: the
    card's busy share (None where nothing measures it); ``seen_extra``: the requests the window's
    batches held beyond the first, on average (clumped arrivals show there, not in the rate)."""
    rate = max(0.0, requests_per_s)
    solo = None if solo_ms is None else rate * solo_ms / 1000.0
    return WaitGather(max(rate * max(0.0, wait_s), seen_extra), cap_requests, solo, rho_max, card_util)


__all__ = ["ENTER_ARRIVALS", "LEAVE_FACTOR", "WaitGather", "wait_gather"]
