"""The low-load wait (gpubroker.broker.control.low_load): when a wait goes to its floor, and the
hysteresis that keeps it from flipping. The rule in the table (``low_load``) is in test_rules.py."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.low_load import ENTER_ARRIVALS, LEAVE_FACTOR, wait_gather

RHO_MAX = 0.9


def floors(rate_rps: float, wait_ms: float, *, at_floor: bool, cap: float = 64, solo_ms: float | None = 0.5) -> bool:
    return wait_gather(rate_rps, wait_ms / 1000.0, cap, solo_ms, RHO_MAX).floors(at_floor)


def test_the_issues_case_floors():
    """0.4 req/s with a 50 ms wait: 0.02 arrivals expected, the request would wait alone."""
    g = wait_gather(0.4, 0.050, 64, 0.5, RHO_MAX)
    assert g.arrivals == pytest.approx(0.02) and g.floors(at_floor=False)


@pytest.mark.parametrize("at_floor", [False, True])
def test_the_thresholds_enter_at_one_arrival_and_leave_at_two(at_floor):
    assert (ENTER_ARRIVALS, LEAVE_FACTOR) == (1.0, 2.0)
    assert floors(19.0, 50.0, at_floor=at_floor)  # 0.95 arrivals: the floor either way
    assert not floors(41.0, 50.0, at_floor=at_floor)  # 2.05: the plan either way


def test_inside_the_band_the_wait_stays_where_it_is():
    """1.5 arrivals: a wait at the floor stays there, a wait at the plan stays there."""
    assert floors(30.0, 50.0, at_floor=True)
    assert not floors(30.0, 50.0, at_floor=False)


def test_a_rate_wandering_around_one_boundary_does_not_flip_the_wait():
    """Rates from 15 to 35 req/s around the 20 req/s that enters (0.75..1.75 arrivals): once at
    the floor it stays; started at the plan it stays until the rate goes under 20."""
    wobble = [15.0, 35.0, 18.0, 33.0, 21.0, 16.0, 34.0, 19.0, 30.0]
    at = True
    for r in wobble:
        at = floors(r, 50.0, at_floor=at)
        assert at
    at, flips = False, 0
    for r in [25.0, 35.0, 22.0, 30.0] + wobble:
        new = floors(r, 50.0, at_floor=at)
        flips += new != at
        at = new
    assert flips == 1  # into the floor at 15/s, never out again inside the band


def test_a_cap_of_one_request_floors_at_any_rate():
    assert floors(1000.0, 50.0, at_floor=False, cap=1.5)
    assert not floors(1000.0, 50.0, at_floor=False, cap=2.0)


def test_a_load_that_needs_batching_keeps_its_wait():
    """0.5 arrivals in a 10 ms wait, but one request at a time (20 ms each) would keep the replica
    100 % busy at 50 req/s: a batch of one would queue, the wait is what forms batches."""
    assert not floors(50.0, 10.0, at_floor=False, solo_ms=20.0)
    assert not floors(50.0, 10.0, at_floor=True, solo_ms=20.0)  # at the floor: left at the ceiling
    # the utilisation has the same band: entered under half the ceiling (0.45), left at it (0.9)
    assert not floors(25.0, 10.0, at_floor=False, solo_ms=20.0)  # 0.5 busy: not entered
    assert floors(25.0, 10.0, at_floor=True, solo_ms=20.0)  # 0.5 busy: not left
    assert floors(20.0, 10.0, at_floor=False, solo_ms=20.0)  # 0.4 busy: entered


def test_a_busy_card_keeps_the_wait():
    """The fixed cost a wait saves is card time its neighbours share: on a card busy over half the
    ceiling the floor is not entered, and at the ceiling it is left, whatever this model's own rate."""
    g = wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, card_util=0.6)
    assert g.arrivals < ENTER_ARRIVALS and not g.floors(at_floor=False)
    assert g.floors(at_floor=True)  # 0.6 is inside the band: a wait at the floor stays there
    assert not wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, card_util=0.95).floors(at_floor=True)
    assert wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, card_util=0.3).floors(at_floor=False)
    assert "card 30% busy" in wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, card_util=0.3).why(0.010)


def test_what_the_batches_held_counts_as_much_as_the_rate():
    """Clumped arrivals: 5 req/s on average (0.05 in a 10 ms wait) but batches of 3.5 requests in
    the window: 2.5 requests came together beyond the first, so the wait gathers them."""
    g = wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, seen_extra=2.5)
    assert g.arrivals == 2.5 and not g.floors(at_floor=False) and not g.floors(at_floor=True)
    assert wait_gather(5.0, 0.010, 64, 0.5, RHO_MAX, seen_extra=0.3).floors(at_floor=False)


def test_without_a_latency_model_the_arrivals_decide():
    assert floors(10.0, 10.0, at_floor=False, solo_ms=None)
    assert not floors(300.0, 10.0, at_floor=False, solo_ms=None)


def test_the_reason_names_the_numbers():
    g = wait_gather(0.4, 0.050, 64, 0.5, RHO_MAX)
    assert g.why(0.050).startswith("0.02 arrivals expected in a 50.0 ms wait per replica (floor under 1, left at 2)")
    assert "cap takes 1.0 request" in wait_gather(5.0, 0.05, 1.0, None, RHO_MAX).why(0.05)
