"""The allocator's slack is learned from what replicas hold against the modelled bytes
(gpubroker.broker.control.memory_model.measured_slack), bounded, and a tenth of the grant until measured."""

from __future__ import annotations

import pytest

from gpubroker.broker.control.memory_model import SLACK_MAX, SLACK_UNMEASURED, MemoryModel, measured_slack
from gpubroker.broker.control.types import ModelLoad

MiB = 1024**2
W, PER, B = 1024 * MiB, 512 * MiB, 8
BASE = W + B * PER  # a base sized for a batch of exactly 8


def _load(peak: int, max_batch: float = 6.0) -> ModelLoad:
    return ModelLoad(
        name="m", weights_bytes=W, bytes_per_unit=float(PER), mem_peak_bytes=peak, max_batch=max_batch, replicas=1
    )


def test_a_replica_that_holds_the_modelled_bytes_leaves_no_slack_and_its_base_holds_its_batch():
    mm = MemoryModel.from_load(_load(W + 6 * PER))
    assert mm.slack_frac == 0.0
    assert mm.cap_for(BASE) == B  # with a tenth of every grant set aside it was 7
    assert mm.grant_for(B) == BASE + 1


def test_until_measured_a_tenth_of_the_grant_is_kept():
    assert MemoryModel.from_load(_load(0)).slack_frac == SLACK_UNMEASURED
    assert MemoryModel(W, PER).cap_for(BASE) == int((BASE * (1 - SLACK_UNMEASURED) - W) // PER) == 7


def test_a_peak_under_the_bytes_of_its_batch_measures_nothing():
    assert MemoryModel.from_load(_load(W + 2 * PER, max_batch=6.0)).slack_frac == SLACK_UNMEASURED


def test_a_measured_slack_is_its_share_of_what_was_held_and_bounded():
    modelled = W + 6 * PER
    held = int(modelled / 0.96)  # 4 % of what it held is beyond the model
    assert measured_slack(held, modelled) == pytest.approx(0.04, abs=1e-6)
    assert MemoryModel.from_load(_load(held)).slack_frac == pytest.approx(0.04, abs=1e-6)
    assert measured_slack(3 * modelled, modelled) == SLACK_MAX
    big = MemoryModel.from_load(_load(3 * modelled))
    assert big.slack_frac == SLACK_MAX and big.cap_for(BASE) < MemoryModel(W, PER).cap_for(BASE)
