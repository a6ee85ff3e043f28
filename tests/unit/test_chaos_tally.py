"""tests/chaos/tally.py: one outcome per answer, by the first rule that matches; a tally that
does not add up raises. Every rule of ``RULES`` has an example here, so a rule that can never
fire is seen; the answers gpubroker's own code writes are classified as the table says."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from bench.loadgen import Record
from tests.chaos.tally import COUNTING, RULES, CountError, Rule, Tally, Verdict, check_row, classify

SHED_503 = {"detail": "model 'slow' queue is full (6 waiting, max_queued 6); retry later"}
LATE_504 = {"detail": "request waited over request_timeout_s (1s) in model 'slow'; retry later or raise the timeout"}
OWN_500 = {"detail": "model 'picky' failed on input: ValueError: cannot read crash-c00r004", "field": "input"}
BATCH_500 = {"detail": "model 'picky' failed running this request: ValueError (the replica's log has the error)"}
OOM_507 = {"detail": "inputs[0] needs 300.0 MiB; the grant is 256.0 MiB", "field": "inputs[0]"}
LOST_503 = {
    "detail": "/v1/models/mlp/infer: the replica serving this request was lost; retry, a replacement is starting"
}

EXAMPLES = [  # (answer, body, rule, verdict, key)
    (200, None, Rule.OUTPUT, Verdict.ANSWERED, "200"),
    (httpx.ReadTimeout("timed out"), None, Rule.CLIENT_TIMEOUT, Verdict.LOST, "client timeout"),
    (httpx.ConnectError("refused"), None, Rule.NO_ANSWER, Verdict.LOST, "no answer"),
    (503, LOST_503, Rule.REPLICA_LOST, Verdict.LOST, "503 replica lost"),
    (408, "Request 1f timed out after 20.0s.", Rule.PROXY_TIMEOUT, Verdict.LOST, "408 proxy timeout"),
    (422, {"detail": "input.x: wrong length", "field": "input.x"}, Rule.BAD_INPUT, Verdict.REFUSED, "422 bad input"),
    (404, {"detail": "unknown model 'MLP'"}, Rule.UNKNOWN_MODEL, Verdict.REFUSED, "404 unknown model"),
    (429, "Too many requests", Rule.BACK_PRESSURE, Verdict.REFUSED, "429 back-pressure"),
    (504, LATE_504, Rule.SHED, Verdict.REFUSED, "504 shed"),
    (507, OOM_507, Rule.OVER_GRANT, Verdict.REFUSED, "507 over its grant"),
    (500, OWN_500, Rule.OWN_INPUT_FAILED, Verdict.REFUSED, "500 model failed on its input"),
    (500, BATCH_500, Rule.NOT_THE_MODEL, Verdict.LOST, "500 not the model's"),
    (302, "", Rule.UNEXPECTED, Verdict.LOST, "302 unexpected status"),
]


@pytest.mark.parametrize(("answer", "body", "rule", "verdict", "key"), EXAMPLES, ids=[str(e[2]) for e in EXAMPLES])
def test_each_rule_names_its_answer(answer, body, rule, verdict, key):
    out = classify(answer, body)
    assert (out.rule, out.verdict, out.key) == (rule, verdict, key)


def test_every_rule_has_an_example():
    assert {r for r, _, _ in RULES} == {e[2] for e in EXAMPLES}


def test_the_docs_table_names_every_rule():
    """docs/RELIABILITY.md is the readers' copy of RULES: each name in it, in the same order."""
    from tests.chaos.harness import ROOT

    doc = (ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8")
    table = doc[doc.index("| what came back |") : doc.index("The choices, and why")]
    named = [r for r, _, _ in RULES if r is not Rule.OUTPUT]  # answered: named by its status (`200`)
    found = [re.search(rf"`(\d{{3}} |<status> )?{re.escape(str(r))}`", table) for r in named]
    assert all(found), [str(r) for r, m in zip(named, found, strict=True) if m is None]
    places = [m.start() for m in found if m is not None]
    assert places == sorted(places), "docs/RELIABILITY.md lists the rules in another order than RULES"


def test_a_5xx_without_gpubrokers_body_is_lost_with_one_a_refusal():
    assert classify(503, SHED_503).verdict is Verdict.REFUSED
    assert classify(503, "Service Unavailable").key == "503 not the model's"  # Serve's plain text
    assert classify(504, "<html>Gateway Timeout</html>").verdict is Verdict.LOST  # a gateway's, not the replica's
    assert classify(507, b"").verdict is Verdict.LOST
    assert classify(502, {"detail": "bad gateway"}).verdict is Verdict.LOST


def test_a_client_timeout_and_a_proxy_timeout_are_lost_the_replicas_deadline_refused():
    assert classify(TimeoutError()).verdict is classify(408).verdict is Verdict.LOST
    assert classify(httpx.ConnectTimeout("x")).rule is Rule.CLIENT_TIMEOUT
    assert classify(504, LATE_504).verdict is Verdict.REFUSED


def test_load_generator_records_and_their_cut_bodies():
    timeout = Record(0, "mlp", 0.0, status=0, error="client timeout after 30s")
    assert classify(timeout).rule is Rule.CLIENT_TIMEOUT
    assert classify(Record(1, "mlp", 0.0, status=0, error="ConnectError('x')")).rule is Rule.NO_ANSWER
    assert classify(Record(2, "mlp", 0.0, status=-1)).rule is Rule.NO_ANSWER  # never sent: lost, not dropped
    long_500 = json.dumps({"detail": "model 'p' failed on inputs[3]: ValueError: " + "x" * 400, "field": "inputs[3]"})
    cut = Record(3, "p", 0.0, status=500, error=long_500[:200])  # loadgen keeps 200 characters
    assert classify(cut).rule is Rule.OWN_INPUT_FAILED
    shed = Record(4, "slow", 0.0, status=503, error=json.dumps(SHED_503)[:40])
    assert classify(shed).rule is Rule.SHED
    assert classify(Record(5, "mlp", 0.0, status=200)).key == "200"


def test_in_process_results_and_responses():
    assert classify({"status": 503, "detail": "queue is full", "retry_after_s": 1}).rule is Rule.SHED
    assert classify({"status": 200, "outputs": [1]}).verdict is Verdict.ANSWERED
    resp = httpx.Response(507, json=OOM_507)
    assert classify(resp).rule is Rule.OVER_GRANT
    with pytest.raises(TypeError, match="cannot classify"):
        classify(object())


def test_the_proxy_middlewares_lost_replica_answer_is_lost():
    from gpubroker.deployments.serve.http_proxy import ExplicitErrors

    sent: list[dict] = []

    async def silent(scope, receive, send):  # Ray's proxy when the replica died under the request
        return None

    async def send(m):
        sent.append(m)

    async def receive():
        return {"type": "http.disconnect"}

    asyncio.run(ExplicitErrors(silent)({"type": "http", "path": "/v1/models/mlp/infer"}, receive, send))
    assert classify(sent[0]["status"], sent[1]["body"]).rule is Rule.REPLICA_LOST


def test_the_replicas_own_answers_are_classified_as_the_table_says():
    from gpubroker.deployments.replica.deployment import batch_failure_detail
    from gpubroker.deployments.replica.oom import ItemError, item_error
    from gpubroker.deployments.serve.http_api import answer_for

    own = answer_for("p", item_error(0, ItemError.of(0, ValueError("bad")), "p"), single=True, retry_after_s=1)
    assert classify(own.status, own.body).rule is Rule.OWN_INPUT_FAILED
    refused = answer_for("p", item_error(1, ItemError.of(1, _input_error()), "p"), single=False, retry_after_s=1)
    assert classify(refused.status, refused.body).rule is Rule.BAD_INPUT
    assert classify(500, {"detail": batch_failure_detail("p", RuntimeError("x"))}).verdict is Verdict.LOST


def _input_error() -> Exception:
    from gpubroker import InputError

    return InputError("text", "too long")


def test_a_tally_adds_up_or_says_by_how_much():
    t = Tally()
    for status, body in ((200, None), (503, SHED_503), (0, None)):
        t.send()
        t.add(httpx.ConnectError("x") if status == 0 else status, body)
    assert (t.sent, t.n_answered, t.n_refused, t.n_lost) == (3, 1, 1, 1)
    assert t.check() is t
    t.send(2)  # two sent, never counted
    with pytest.raises(CountError, match=r"sent 5 != answered 1 \+ refused 1 \+ lost 1 \(3\); \+2 unaccounted"):
        t.check("row x")
    t.add(200)
    t.add(200)
    t.add(200)  # one counted twice
    with pytest.raises(CountError, match="-1 unaccounted"):
        t.check()


def test_tallies_add_and_of_counts_a_plans_answers():
    a = Tally.of([200, 200, 422], sent=3)
    b = Tally.of([Record(0, "m", 0.0, status=0, error="client timeout after 1s")], sent=1)
    both = (a + b).check()
    assert both.answered == {"200": 2} and both.refused == {"422 bad input": 1} and both.lost == {"client timeout": 1}
    row = both.to_row()
    assert row["counting"] == COUNTING and (row["sent"], row["answered"], row["refused"], row["lost"]) == (4, 2, 1, 1)
    check_row(row)  # a written row adds up again


def test_a_written_row_that_does_not_add_up_or_predates_the_count_is_refused():
    row = Tally.of([200, 422], sent=2).to_row()
    with pytest.raises(CountError, match="sent 3"):
        check_row({**row, "sent": 3})
    with pytest.raises(CountError, match="differ from their counts by status"):
        check_row({**row, "refused_by": {}})
    with pytest.raises(CountError, match="recount it with `make chaos`"):
        check_row({"sent": 2, "answered": 2, "rejected": 0, "lost": 0})
