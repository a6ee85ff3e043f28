"""bench/output_hashes.py: the same run hashes the same; a different answer hashes differently."""

from __future__ import annotations

from bench import output_hashes


def test_the_same_run_gives_the_same_hashes_and_another_seed_others():
    first = output_hashes.scale_hashes(2, 6, 20.0)
    assert output_hashes.scale_hashes(2, 6, 20.0) == first
    other = output_hashes.scale_hashes(2, 6, 20.0, seed=4)  # other reports: other replies and log
    assert other[0] != first[0] and other[1] != first[1]


def test_the_simulator_hash_leaves_out_the_wall_time():
    assert output_hashes.sim_hash(models=4, seconds=20.0) == output_hashes.sim_hash(models=4, seconds=20.0)
