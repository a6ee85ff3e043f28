"""``gpubroker up`` on a Ray cluster whose nodes do not declare the config's cards (no Ray: the
nodes are ``ray.nodes()``-shaped dicts)."""

from __future__ import annotations

import pytest

from gpubroker.deployments.cluster.discovery import missing_cards, missing_cards_fix
from gpubroker.deployments.cluster.fleet import _check_cards
from gpubroker.deployments.cluster.local_ray import FleetError
from gpubroker.quotas.config import load_config


def _node(node_id: str, *cards: str, alive: bool = True) -> dict:
    return {
        "NodeID": node_id,
        "Alive": alive,
        "Resources": {"CPU": 2.0, **{f"gpubroker_card_{c}": 1000.0 for c in cards}},
    }


@pytest.fixture(scope="module")
def cluster():
    return load_config("configs/cluster-demo.yaml")


def test_a_cluster_without_the_cards_is_refused_with_the_ray_start_lines(cluster):
    state = {"started_ray": False, "address": "10.0.0.5:6379", "pgid": None}
    with pytest.raises(FleetError) as err:
        _check_cards(cluster, state, [_node("h")])  # a Ray head without any card resource
    msg = str(err.value)
    assert "no node of the Ray cluster at 10.0.0.5:6379 declares any of them" in msg
    assert (
        "ray start --address 10.0.0.5:6379 --resources "
        '\'{"gpubroker_card_a0": 1000, "gpubroker_card_a1": 1000}\' --labels gpubroker.io/node=node-a'
    ) in msg
    assert '"gpubroker_card_b0": 1000, "gpubroker_card_b1": 1000' in msg and "gpubroker.io/node=node-b" in msg


def test_cards_of_a_node_not_joined_yet_are_named_in_the_progress(cluster):
    state = {"started_ray": False, "address": "x:6379", "pgid": None}
    nodes = [_node("a", "a0", "a1"), _node("b", "b0", "b1", alive=False)]
    assert _check_cards(cluster, state, nodes) == " (cards b0, b1 on no node yet)"
    assert [c.id for c in missing_cards(cluster.gpus, nodes)] == ["b0", "b1"]
    nodes[1]["Alive"] = True
    assert _check_cards(cluster, state, nodes) == ""


def test_fleets_without_listed_cards_are_not_checked():
    cfg = load_config("configs/demo.yaml")
    assert _check_cards(cfg, {"started_ray": False, "address": "x", "pgid": None}, []) == ""


def test_the_fix_groups_the_cards_by_node(cluster):
    fix = missing_cards_fix(cluster.gpus[2:], "h:1")
    assert fix.count("ray start") == 1 and "node-b" in fix and "a0" not in fix


def test_the_ports_ray_start_gets_are_distinct_and_free(monkeypatch):
    """``ray start`` refuses two components on one port; picking each port with its own
    bind-and-close can hand one port out twice (seen live: the GCS and the dashboard agent). The
    ports are picked with every socket held: never equal to each other, nor to the one avoided."""
    import socket

    from gpubroker.deployments.cluster import local_ray

    handed = iter([40001, 40001, 40002, 40003, 40003, 40004])  # what a racy OS could hand out

    class FakeSocket:
        def __init__(self) -> None:
            self.port = next(handed)

        def bind(self, addr) -> None:  # noqa: ANN001
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass

    monkeypatch.setattr(socket, "socket", FakeSocket)
    assert local_ray.free_ports(3, avoid=(40002,)) == [40001, 40003, 40004]
    monkeypatch.undo()
    real = local_ray.free_ports(5)
    assert len(set(real)) == 5 and all(local_ray.port_free(p) for p in real)
