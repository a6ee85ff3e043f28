"""Cost per 1k requests: the card-hours a model holds, at the active profile's price, over its requests.

A model that holds a share of a card holds that share of the card's cost, whether it computes
or idles: memory held is memory no one else can use. Over a window of ``window_s`` seconds, a
model granted ``grant_bytes`` of a card with ``usable_bytes`` holds ``grant / usable`` of the card
for ``window_s / 3600`` hours, at ``price_per_gpu_hour``; divided by the requests it completed
in that window, times 1000. A model on several cards sums its share of each. The whole card's
cost per hour is its price (``card_cost_per_hour``). Pure arithmetic, no clock.
"""

from __future__ import annotations


def card_hours(grant_bytes: int, usable_bytes: int, window_s: float) -> float:
    """Card-hours held: the grant's share of the card's usable memory over the window."""
    if usable_bytes <= 0 or window_s <= 0:
        return 0.0
    return max(0, grant_bytes) / usable_bytes * window_s / 3600.0


def cost_per_1k_requests(
    price_per_gpu_hour: float, grant_bytes: int, usable_bytes: int, window_s: float, completions: int
) -> float | None:
    """Cost of 1000 requests at the price in force (None: no completions in the window)."""
    if completions <= 0:
        return None
    return price_per_gpu_hour * card_hours(grant_bytes, usable_bytes, window_s) / completions * 1000.0
