"""A model placed on several cards: its app is a router over one deployment per card (no Ray)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from gpubroker.deployments.serve.http_cards import CardRouter, pick_group
from gpubroker.quotas.config import load_config, parse_config_text
from gpubroker.quotas.placement import place_fleet


def test_the_router_sends_to_the_least_loaded_group_per_replica():
    assert pick_group({"a0": 0, "b0": 0}, {"a0": 1, "b0": 1}) == "a0"  # ties: the first card
    assert pick_group({"a0": 3, "b0": 1}, {"a0": 1, "b0": 1}) == "b0"
    assert pick_group({"a0": 3, "b0": 2}, {"a0": 4, "b0": 1}) == "a0"  # 0.75 per replica against 2


def test_cluster_demo_apps_follow_the_placement():
    from gpubroker.deployments.app import fleet_apps
    from gpubroker.deployments.serve.placement_resources import card_resource

    cfg = load_config("configs/cluster-demo.yaml")
    text = open("configs/cluster-demo.yaml", encoding="utf-8").read()
    placement = place_fleet(cfg)
    apps = {a.name: a.app for a in fleet_apps(cfg, text)}
    for model in cfg.models:
        app = apps[f"gpubroker-{model}"]
        ingress = app._bound_deployment  # noqa: SLF001 - the bound graph Serve will deploy
        cards = placement.cards_of(model)
        if len(cards) == 1:
            opts = ingress.ray_actor_options
            assert card_resource(cards[0]) in opts["resources"]  # asks for its card's resource
            assert ingress._name == model  # noqa: SLF001
        else:
            assert ingress.func_or_class.__name__ == "CardRouter"
            groups = ingress.init_args[2]
            assert set(groups) == set(cards)
            for cid, dep in groups.items():
                assert card_resource(cid) in dep._bound_deployment.ray_actor_options["resources"]  # noqa: SLF001
                assert dep._bound_deployment.init_args[2] == cid  # noqa: SLF001 - the replica knows its card


def test_the_router_skips_lost_cards_and_says_when_none_is_left():
    assert pick_group({"a0": 5, "b0": 0}, {"a0": 1, "b0": 1}, frozenset({"b0"})) == "a0"
    assert pick_group({"a0": 0, "b0": 0}, {"a0": 1, "b0": 1}, frozenset({"a0", "b0"})) is None


class _Group:
    """A card group's handle (fake: no Ray): ``infer`` answers once ``release`` is set, or never."""

    def __init__(self, release: asyncio.Event | None) -> None:
        self.release, self.calls, self.cancelled = release, 0, 0
        self.infer = self

    def remote(self, inputs, nbytes):  # noqa: ANN001, ANN201 - DeploymentHandle.infer.remote
        self.calls += 1
        group = self

        class _Response:
            def cancel(self) -> None:
                group.cancelled += 1

            def __await__(self):  # noqa: ANN204
                return self._wait().__await__()

            async def _wait(self) -> dict:
                await (group.release or asyncio.Event()).wait()
                return {"status": 200, "outputs": [len(inputs)]}

        return _Response()


def _request(body: bytes = b'{"inputs": [{}]}') -> Request:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/models/mlp/infer",
        "root_path": "/v1/models/mlp",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    return Request(scope, receive)


def test_a_request_waiting_on_a_card_that_is_lost_gets_an_explicit_503_and_the_next_goes_elsewhere():
    """The broker's lost cards reach the router off the request path (a fake broker here): the
    request stuck on b0 (its replica died with the node) is answered 503 naming the card and
    Serve's call is cancelled; later requests go to a0 only; with both lost, 503 at once."""
    text = open("configs/cluster-demo.yaml", encoding="utf-8").read()
    lost: set[str] = set()

    class Router(CardRouter):
        async def health_now(self) -> dict[str, list[str]]:
            return {"lost": sorted(lost), "silent": []}

    async def run() -> None:
        released = asyncio.Event()
        released.set()
        a0, b0 = _Group(released), _Group(None)  # b0 never answers: its node is gone
        router = Router("mlp", parse_config_text(text), {"a0": a0, "b0": b0}, {"a0": 1, "b0": 1})
        router.poll_s = 0.01
        first = await router.answer(_request())  # a0 (ties: the first card)
        assert first.status == 200 and a0.calls == 1
        router.in_flight["a0"] += 5  # a0 busy: the next goes to b0 and waits there
        stuck = asyncio.create_task(router.answer(_request()))
        await asyncio.sleep(0.05)
        assert b0.calls == 1 and not stuck.done()
        lost.add("b0")
        answer = await asyncio.wait_for(stuck, timeout=5)
        assert answer.status == 503 and "card b0 was lost" in answer.body["detail"], answer.body
        assert answer.headers["Retry-After"] and b0.cancelled == 1
        assert router.in_flight["b0"] == 0 and not router.waiting["b0"]
        after = await router.answer(_request())
        assert after.status == 200 and (a0.calls, b0.calls) == (2, 1)  # a0 though it is busier
        lost.add("a0")
        await asyncio.sleep(0.05)
        none_left = await router.answer(_request())
        assert none_left.status == 503 and "no live card: a0, b0 lost" in none_left.body["detail"]
        assert (a0.calls, b0.calls) == (2, 1)  # refused before any group
        lost.clear()
        await asyncio.sleep(0.05)
        router.in_flight["a0"] -= 5
        assert (await router.answer(_request())).status == 200  # the cards are back
        router._watch_task.cancel()  # noqa: SLF001

    asyncio.run(run())


def test_a_silent_card_gets_no_new_request_while_another_card_reports():
    """Silent (its replicas stopped reporting, not lost yet): new requests go elsewhere, what
    waits there is left alone (it may be slow, not gone); when every card is silent, they are
    used all the same."""
    text = open("configs/cluster-demo.yaml", encoding="utf-8").read()

    async def run() -> None:
        released = asyncio.Event()
        released.set()
        a0, b0 = _Group(released), _Group(released)
        router = CardRouter("mlp", parse_config_text(text), {"a0": a0, "b0": b0}, {"a0": 1, "b0": 1})
        router._ensure_watch = lambda: None  # noqa: SLF001 - no broker here: health set by hand
        router.set_health(lost=[], silent=["a0", "x9"])  # x9: not one of this model's cards
        assert router.silent == frozenset({"a0"})
        for _ in range(3):
            assert (await router.answer(_request())).status == 200
        assert (a0.calls, b0.calls) == (0, 3)  # a0 first on ties, but silent
        router.set_health(lost=[], silent=["a0", "b0"])
        assert (await router.answer(_request())).status == 200
        assert (a0.calls, b0.calls) == (1, 3)  # all silent: the usual choice
        router.set_health(lost=["b0"], silent=["a0", "b0"])
        assert router.silent == frozenset({"a0"}) and router.lost == frozenset({"b0"})
        assert (await router.answer(_request())).status == 200
        assert (a0.calls, b0.calls) == (2, 3)  # lost beats silent

    asyncio.run(run())
