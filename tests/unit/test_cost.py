"""Cost per 1k requests is the card-hours a model holds at the price in force (gpubroker.broker.control.cost)."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.cost import card_hours, cost_per_1k_requests

GiB = 1024**3


def test_card_hours_is_the_grants_share_of_the_card_over_the_window():
    assert card_hours(2 * GiB, 8 * GiB, 3600.0) == pytest.approx(0.25)
    assert card_hours(8 * GiB, 8 * GiB, 1800.0) == pytest.approx(0.5)
    assert card_hours(1 * GiB, 0, 3600.0) == 0.0


def test_cost_per_1k_requests():
    # a quarter of a $4/h card for an hour is $1; over 10,000 requests that is $0.10 per 1k
    assert cost_per_1k_requests(4.0, 2 * GiB, 8 * GiB, 3600.0, 10_000) == pytest.approx(0.10)
    # the same requests on twice the grant cost twice as much: memory held is paid for, busy or idle
    assert cost_per_1k_requests(4.0, 4 * GiB, 8 * GiB, 3600.0, 10_000) == pytest.approx(0.20)
    assert cost_per_1k_requests(4.0, 2 * GiB, 8 * GiB, 3600.0, 0) is None


def test_a_model_on_two_cards_pays_for_both():
    from tests.unit.test_fleet_core import _fleet, _report

    clock, fb, running, seq = _fleet()
    for _ in range(10):
        clock.t += 0.5
        _report(fb, running, seq, clock, busy={("hot", "a0"), ("hot", "b0")})
        clock.t += 0.5
        fb.tick()
    st = fb.status()
    per_card = [fb.cores[c].status()["models"]["hot"] for c in ("a0", "b0")]
    spent = sum(m["cost_per_1k_requests"] * m["completions"] / 1000 for m in per_card)
    done = sum(m["completions"] for m in per_card)
    assert st["models"]["hot"]["cost_per_1k_requests"] == pytest.approx(spent / done * 1000)
    assert [c["price_per_gpu_hour"] for c in st["cards"]] == [
        fb.cores[c].status()["price_per_gpu_hour"] for c in ("a0", "b0")
    ]
