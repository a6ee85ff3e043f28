"""A Ray cluster of emulated cards on one machine, for the cluster tests (``ray.cluster_utils.Cluster``).

``CardCluster(cfg)`` starts one Ray node per node named in the config's ``gpus:`` (the first is
the head), each declaring its cards as custom resources (``gpubroker_card_<id>: 1000``) and the
``gpubroker.io/node`` label, exactly what ``gpubroker.deployments.serve.placement_resources.node_start_args``
tells a user to pass to ``ray start``. Nodes get few CPUs (this machine has two cores for all).
One ``CardCluster`` per test module: start it in a module fixture, ``shutdown()`` at the end.

    cc = CardCluster(load_config("configs/cluster-demo.yaml"))
    cc.node_of_card("b0")   # Ray node id of the node holding card b0
    cc.kill_node("node-b")  # node loss
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gpubroker.deployments.serve.placement_resources import node_labels, node_resources
from gpubroker.quotas.cards import Card, fleet_cards

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def wait_until(check: Callable[[], Any], timeout_s: float = 60.0, every_s: float = 0.5, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what} not reached in {timeout_s:.0f} s (last: {last!r})")


class CardCluster:
    """One Ray node per config node, its emulated cards declared as resources; the driver connected."""

    def __init__(self, cfg: Any, *, num_cpus_per_node: float = 1, namespace: str = "gpubroker-cluster-test") -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cards: tuple[Card, ...] = fleet_cards(cfg.gpu, cfg.gpus)
        self.node_names: list[str] = list(dict.fromkeys(c.node for c in self.cards))
        self.cluster = Cluster(shutdown_at_exit=True)
        self.nodes: dict[str, Any] = {}
        for name in self.node_names:
            mine = [c for c in self.cards if c.node == name]
            args: dict[str, Any] = {
                "num_cpus": num_cpus_per_node,
                "resources": node_resources(mine),
                "labels": node_labels(name, mine),
            }
            if not self.nodes:
                args["include_dashboard"] = False
            self.nodes[name] = self.cluster.add_node(**args)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=namespace, logging_level="ERROR", log_to_driver=False)
        self.head = self.node_names[0]

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def node_of_card(self, card_id: str) -> str:
        """Ray node id of the (alive) node declaring the card's resource."""
        from gpubroker.deployments.cluster.discovery import card_nodes

        return card_nodes()[card_id]

    def card_nodes(self) -> dict[str, str]:
        """card id -> Ray node id, for the alive nodes."""
        from gpubroker.deployments.cluster.discovery import card_nodes

        return card_nodes()

    def kill_node(self, name: str) -> None:
        """Node loss: every process of that node, at once (not the head: the driver lives there)."""
        if name == self.head:
            raise ValueError(f"{name} is the head node (the driver is connected to it); kill a worker node")
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def add_node(self, name: str) -> None:
        """Bring a node (back) with its cards."""
        mine = [c for c in self.cards if c.node == name]
        self.nodes[name] = self.cluster.add_node(
            num_cpus=1, resources=node_resources(mine), labels=node_labels(name, mine)
        )
        self.cluster.wait_for_nodes()

    def shutdown(self) -> None:
        import ray

        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - Serve may never have started
            pass
        ray.shutdown()
        self.cluster.shutdown()


@contextmanager
def deployed_fleet(
    config_text: str, fleet_app: str, *, follow: bool = False, model_num_cpus: float = 0.05
) -> Iterator[tuple[CardCluster, str, Any]]:
    """A ``CardCluster`` for the config, its broker, Serve (head-only proxy on a free port) and the
    fleet deployed and running; with ``follow`` the fleet API applies the broker's re-placements
    to Serve (``gpubroker.deployments.serve.follow``). Yields (cluster, base URL, broker handle); shuts it all down after."""
    from ray import serve

    from gpubroker.broker.actor import start_broker
    from gpubroker.deployments.app import AppLayout, fleet_apps, run_fleet
    from gpubroker.deployments.cluster.local_ray import free_port
    from gpubroker.deployments.serve.reconcile import ServeReconciler
    from gpubroker.quotas.config import parse_config_text

    cfg = parse_config_text(config_text)
    cc = CardCluster(cfg)
    try:
        broker = start_broker(config_text)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        rec = ServeReconciler(cfg, config_text, fleet_app=fleet_app, model_num_cpus=model_num_cpus) if follow else None
        layout = AppLayout(fleet_app=fleet_app, model_num_cpus=model_num_cpus)
        apps = fleet_apps(cfg, config_text, layout, reconciler=rec)
        run_fleet(apps, wait=True)
        yield cc, f"http://127.0.0.1:{port}", broker
    finally:
        cc.shutdown()
