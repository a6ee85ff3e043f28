"""The live fleet on real Ray Serve (CPU): HTTP answers, batch caps, quota lending, apply, restart.

One Ray instance and one deployed fleet (tests/integration/fleet.yaml) for the whole module;
tests run in file order and each leaves the fleet serving.
"""

from __future__ import annotations

import math

import httpx
import pytest

from tests.integration._load import open_loop, open_loop_bg
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

MIB = 1024**2


def post(fleet, model: str, body) -> httpx.Response:
    return httpx.post(f"{fleet.url}/v1/models/{model}/infer", json=body, timeout=60)


def assert_grants_fit(st: dict) -> None:
    total = sum(m["grant_bytes"] for m in st["models"].values())
    assert total <= st["usable_bytes"], f"sum of grants {total} > usable {st['usable_bytes']}"


# ------------------------------------------------------------------------------- models
def test_minilm_embeds_over_http(fleet):
    texts = ["the cat sat on the mat", "gpubroker shares one GPU", "hi"]
    r = post(fleet, "minilm", {"inputs": [{"text": t} for t in texts]})
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    assert len(outs) == 3
    for out in outs:
        emb = out["embedding"]
        assert len(emb) == 384
        assert math.isclose(math.sqrt(sum(x * x for x in emb)), 1.0, rel_tol=1e-3)
    alone = post(fleet, "minilm", {"input": {"text": texts[2]}}).json()["output"]["embedding"]
    assert max(abs(a - b) for a, b in zip(alone, outs[2]["embedding"])) < 1e-4  # padding is masked


def test_minilm_embeds_with_the_openai_client_through_its_replicas(fleet):
    """``POST /v1/embeddings`` with the real ``openai`` client (it asks for base64 unless told
    otherwise): the vectors /infer gives, in order, the tokens counted, the broker counting them."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=60, max_retries=0)
    texts = ["the cat sat on the mat", "hi"]
    out = client.embeddings.create(model="minilm", input=texts)  # the client's default: base64
    assert [d.index for d in out.data] == [0, 1] and out.model == "minilm"
    assert out.usage.prompt_tokens == out.usage.total_tokens == (6 + 2) + (1 + 2)  # words + [CLS]/[SEP]
    infer = post(fleet, "minilm", {"inputs": [{"text": t} for t in texts]}).json()["outputs"]
    for d, ref in zip(out.data, infer):
        assert len(d.embedding) == 384
        assert max(abs(a - b) for a, b in zip(d.embedding, ref["embedding"])) < 1e-4
    floats = client.embeddings.create(model="minilm", input="hi", encoding_format="float")
    assert (
        len(floats.data) == 1
        and max(abs(a - b) for a, b in zip(floats.data[0].embedding, out.data[1].embedding)) < 1e-6
    )
    many = [f"sentence number {i}" for i in range(24)]
    assert len(client.embeddings.create(model="minilm", input=many, encoding_format="float").data) == 24
    wait_for(lambda: fleet.status()["models"]["minilm"]["completions"] >= 24, 30, what="the broker counting them")


def test_embeddings_errors_in_openais_shape(fleet):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(openai.NotFoundError) as nf:
        client.embeddings.create(model="nope", input="x")
    assert (nf.value.code, nf.value.param, nf.value.type) == ("model_not_found", "model", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as no:
        client.embeddings.create(model="mlp", input="x")  # served, but it does not embed
    assert (no.value.code, no.value.param) == ("model_not_embedding", "model")
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model="minilm", input="x", dimensions=8)
    assert (bad.value.code, bad.value.param) == ("unsupported_parameter", "dimensions")
    with pytest.raises(openai.UnprocessableEntityError) as long:  # the model's own check, in its replica
        client.embeddings.create(model="minilm", input=["ok", "word " * 300], encoding_format="float")
    assert (long.value.code, long.value.param) == ("invalid_input", "input[1]") and "256" in long.value.message
    with pytest.raises(openai.APIStatusError) as big:  # over minilm's max_body_bytes (64KiB), its replica's 413
        client.embeddings.create(model="minilm", input=["a " * 40000], encoding_format="float")
    assert big.value.status_code == 413 and big.value.code == "body_too_large"


def test_classifiers_answer_over_http(fleet):
    image = [[[((k + y + x) % 7) / 7.0 for x in range(32)] for y in range(32)] for k in range(3)]
    r = post(fleet, "cnn", {"inputs": [{"image": image}, {"image": image}]})
    assert r.status_code == 200, r.text
    logits = [o["logits"] for o in r.json()["outputs"]]
    assert len(logits) == 2 and len(logits[0]) == 10
    assert max(abs(a - b) for a, b in zip(*logits)) < 1e-5
    r = post(fleet, "mlp", {"input": {"x": [0.1] * 64}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output"]["logits"]) > 1


def test_http_errors(fleet):
    r = post(fleet, "nope", {"input": {}})
    assert r.status_code == 404 and "minilm" in r.json()["detail"]
    r = post(fleet, "mlp", {"input": {"x": [1, 2]}})
    assert r.status_code == 422 and r.json()["field"] == "input.x"
    r = post(fleet, "mlp", {"inputs": [{"x": [0.0] * 64}, {"y": 1}]})
    assert r.status_code == 422 and r.json()["field"].startswith("inputs[1]")
    r = httpx.post(f"{fleet.url}/v1/models/mlp/infer", content=b"{oops", timeout=30)
    assert r.status_code == 422 and r.json()["field"] == "body"
    big = b'{"input": {"text": "' + b"a " * 40000 + b'"}}'  # over minilm's 64KiB, not valid for it either
    r = httpx.post(f"{fleet.url}/v1/models/minilm/infer", content=big, timeout=30)
    assert r.status_code == 413
    st = httpx.get(f"{fleet.url}/v1/status", timeout=30)
    assert st.status_code == 200 and set(st.json()["models"]) == set(fleet.cfg.models)


# ------------------------------------------------------------------------------- apply
def test_a_fast_model_at_low_load_answers_without_waiting(fleet):
    """At about 0.5 req/s a batch wait gathers nothing (0.025 arrivals expected in 50 ms): the
    broker takes mlp's wait to wait.min_ms (rule low_load, docs/RULES.md) and the replica answers
    in well under wait.max_ms. (The lazy plan's wait at this SLO is wait.max_ms: every request used
    to wait it out alone.) The replica's own latency (its answer's ``latency_ms``: admission, the
    batch wait, the model) is what is compared; the HTTP path around it on a shared 2-core machine
    is not the wait's."""
    import time

    wait = fleet.cfg.models["mlp"].wait
    assert wait.max_ms >= 40 and wait.min_ms == 0  # the defaults: a wait would show in the latency
    body = {"input": {"x": [0.1] * 64}}
    replica_ms = []
    for _ in range(10):  # 2 s apart: the rate window (5 s) sees 0.5 req/s, the broker ticks every 0.5 s
        r = post(fleet, "mlp", body)
        assert r.status_code == 200, r.text
        replica_ms.append(r.json()["latency_ms"])
        time.sleep(2.0)
    assert fleet.status()["models"]["mlp"]["batch_wait_timeout_s"] == wait.min_ms / 1000.0
    settled = sorted(replica_ms[4:])  # after the first ticks at this load
    assert settled[len(settled) // 2] < 0.5 * wait.max_ms, replica_ms


def test_bad_config_changes_nothing(fleet):
    import ray

    before = fleet.status()
    bad = fleet.text.replace("base: 128MiB, max: 512MiB", "base: 900MiB, max: 512MiB")
    res = ray.get(fleet.broker.apply.remote(bad))
    assert not res["ok"] and res["issues"] and res["config_hash"] == before["config_hash"]
    res = ray.get(fleet.broker.apply.remote("models: [not, a, mapping"))
    assert not res["ok"] and "YAML" in res["issues"][0]
    fewer = fleet.text.replace("  cold:\n", "  colder:\n")
    res = ray.get(fleet.broker.apply.remote(fewer))
    assert not res["ok"] and "gpubroker up" in res["issues"][0]
    after = fleet.status()
    assert after["config_hash"] == before["config_hash"]
    assert {n: m["grant_bytes"] for n, m in after["models"].items()} == {
        n: m["grant_bytes"] for n, m in before["models"].items()
    }


# ------------------------------------------------------------------------------- control
def test_busy_model_cap_up_quota_lent_then_back(fleet):
    """hot under load: cap rises and it borrows from idle cold; load stops: cap falls, loan returns;
    cold's load returns: cold reclaims its base. Sum of grants <= usable in every status."""
    statuses = []

    def snap():
        st = fleet.status()
        assert_grants_fit(st)
        statuses.append(st)
        return st

    hot0 = snap()["models"]["hot"]
    base_hot, base_cold = hot0["base_bytes"], snap()["models"]["cold"]["base_bytes"]
    wait_for(lambda: snap()["models"]["cold"]["arrival_rate_rps"] == 0, 30, what="cold idle")
    body = {"inputs": [{}] * 8}
    thread, codes = open_loop_bg(fleet.url, "hot", 20.0, 12.0, body, seed=1)
    try:
        wait_for(lambda: snap()["models"]["hot"]["max_batch_size"] > hot0["max_batch_size"], 12, what="hot cap up")
        wait_for(lambda: snap()["models"]["hot"]["grant_bytes"] > base_hot, 12, what="hot borrows")
        lent = snap()["models"]["cold"]["grant_bytes"]
        assert lent < base_cold
    finally:
        thread.join(timeout=60)
    # 503 (back-pressure, with Retry-After) is allowed while the cap is still low; nothing else
    hot_end = snap()["models"]["hot"]
    assert set(codes) <= {200, 503} and codes[200] >= 0.8 * sum(codes.values()), (codes, hot_end)
    peak_cap = max(s["models"]["hot"]["max_batch_size"] for s in statuses)
    wait_for(lambda: snap()["models"]["hot"]["max_batch_size"] < peak_cap, 20, what="hot cap down")
    # idle_hold_s, then the replica's peak ageing out of the 5 s window (host RSS can lag): allow 45 s
    wait_for(lambda: snap()["models"]["hot"]["grant_bytes"] <= base_hot, 45, what="hot loan returned")
    # cold's load comes back: it reclaims its base
    codes = open_loop(fleet.url, "cold", 20.0, 5.0, {"inputs": [{}] * 2}, seed=2)
    assert set(codes) == {200}, codes
    wait_for(lambda: snap()["models"]["cold"]["grant_bytes"] >= base_cold, 15, what="cold reclaims base")
    moves = [d for d in __import__("ray").get(fleet.broker.decisions.remote()) if d["kind"] == "move"]
    assert any(m["recipient"] == "hot" and m["donor"] == "cold" for m in moves), moves
    for st in statuses:
        assert_grants_fit(st)


# ------------------------------------------------------------------------------- restart
def test_broker_restart_resumes_while_serving(fleet):
    import ray

    before = fleet.status()
    ray.get(fleet.broker.checkpoint_now.remote())
    thread, codes = open_loop_bg(fleet.url, "mlp", 20.0, 6.0, {"input": {"x": [0.2] * 64}}, seed=3)
    ray.kill(fleet.broker, no_restart=False)

    def restarted():
        try:
            st = ray.get(fleet.broker.status.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - restarting
            return None
        return st if st["pid"] != before["pid"] else None

    after = wait_for(restarted, 60, interval_s=0.5, what="broker restart")
    thread.join(timeout=60)
    assert codes[200] > 0 and set(codes) == {200}, codes  # deployments kept serving
    assert after["restored"] is True
    assert after["config_hash"] == before["config_hash"]
    assert after["decision_seq"] >= before["decision_seq"]
    for name, m in before["models"].items():
        assert after["models"][name]["settings_version"] >= m["settings_version"]
    assert_grants_fit(after)
    # the replicas report to the restarted broker again
    wait_for(
        lambda: fleet.status()["models"]["mlp"]["replicas"] == 1 and fleet.status()["ticks"] > 2,
        20,
        what="reports after restart",
    )
