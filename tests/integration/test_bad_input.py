"""A bad input fails alone, on real Ray Serve (CPU, real HTTP): several clients at once send
interleaved good and bad requests to one model (``tests/integration/picky_model.py``) whose
``predict`` raises on a bad input with a message quoting every input of its batch. A static batch
of up to 16 with a 50 ms wait makes concurrent requests share batches (the model's own log shows
that batches holding good and bad inputs ran and raised).

Every body is checked: a good request gets its own output; a refused one (``InputError`` in
``predict``) 422 naming ``input.text`` and its own text; a failing one (``ValueError``) 500 naming
the model, the exception and its own text; no body holds another request's marker. Counted by
``tests/chaos/tally.py``: sent = answered + refused (by status: 422 bad input, 500 the model failed
on its own input) + lost, and lost must be 0. One Ray and one fleet for the module.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest

from tests.chaos.harness import FaultKind, Faults
from tests.chaos.tally import Tally
from tests.integration._fleet import local_fleet
from tests.integration.picky_model import batches

pytestmark = pytest.mark.integration

CLIENTS = 6
REQUESTS_PER_CLIENT = 20
KINDS = ("good", "good", "refuse", "good", "crash")  # each client starts at its own place in the cycle

CONFIG = """
broker: {{name: gpubroker-picky, namespace: gpubroker-picky, control_interval_s: 0.5,
         report_interval_s: 0.25, metrics_port: 0, http_host: 127.0.0.1, http_port: 8000}}
gpu: {{device: cpu, capacity: 1GiB, reserve_frac: 0.0, emergency_free_frac: 0.01}}
models:
  picky:
    model: tests.integration.picky_model:PickyModel
    options: {{log_dir: "{log_dir}"}}
    quota: {{min: 64MiB, base: 256MiB, max: 256MiB}}
    batch: {{floor: 1, ceiling: 16, initial: 16}}
    wait: {{min_ms: 0, max_ms: 50, initial_ms: 50}}
    control: {{strategy: static}}
    slo_p95_ms: 5000
    max_queued: 512
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("picky")
    with local_fleet(CONFIG.format(log_dir=log_dir)) as (url, _broker, _cfg):
        yield url, log_dir


def marker(client: int, req: int) -> str:
    """The request's text: its kind and a tag no other tag contains (``crash-c03r017``)."""
    kind = KINDS[(client + req) % len(KINDS)]
    return f"{kind}-c{client:02d}r{req:03d}"


def _client(url: str, client: int, answers: dict[str, tuple[int, str]], tally: Tally) -> None:
    with httpx.Client(timeout=60) as http:
        for req in range(REQUESTS_PER_CLIENT):
            text = marker(client, req)
            try:
                r = tally.call(lambda t=text: http.post(f"{url}/v1/models/picky/infer", json={"input": {"text": t}}))
                answers[text] = (r.status_code, r.text)
            except httpx.HTTPError as exc:  # no answer: counted lost
                answers[text] = (0, repr(exc))


def judge(text: str, status: int, body_text: str, everyone: list[str]) -> str:
    """'answered', 'refused' or why the answer is wrong (wrong status, wrong body, another's text)."""
    leaked = [other for other in everyone if other != text and other in body_text]
    if leaked:
        return f"wrong: holds {leaked[:3]}"
    try:
        body = json.loads(body_text)
    except ValueError:
        return f"wrong: {status} without a JSON body"
    kind = text.split("-")[0]
    if kind == "good" and status == 200 and body.get("output") == {"echo": text, "length": len(text)}:
        return "answered"
    if kind == "refuse" and status == 422 and body == {"detail": f"input.text: refused: {text}", "field": "input.text"}:
        return "refused"
    want_500 = f"model 'picky' failed on input: ValueError: cannot read {text}"
    if kind == "crash" and status == 500 and body == {"detail": want_500, "field": "input"}:
        return "refused"
    return f"wrong: {status} {body_text[:200]}"


@pytest.mark.chaos
def test_interleaved_bad_inputs_from_many_clients_fail_alone(fleet):
    url, log_dir = fleet
    answers: dict[str, tuple[int, str]] = {}
    tallies = [Tally() for _ in range(CLIENTS)]  # one per client thread: a Counter is not shared across threads
    threads = [threading.Thread(target=_client, args=(url, c, answers, tallies[c])) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    everyone = [marker(c, r) for c in range(CLIENTS) for r in range(REQUESTS_PER_CLIENT)]
    verdicts = {text: judge(text, *answers.get(text, (0, "never answered")), everyone) for text in everyone}
    statuses = Counter(answers.get(text, (0, ""))[0] for text in everyone)
    tally = sum(tallies, Tally())
    wrong = {text: v for text, v in verdicts.items() if v.startswith("wrong")}
    kinds = Counter(text.split("-")[0] for text in everyone)
    calls = batches(log_dir)
    mixed = [c for c in calls if c["raised"] and any(t.startswith("good") for t in c["texts"])]
    clients_in = [{t.split("-")[1][:3] for t in c["texts"]} for c in mixed]
    faults = Faults("test_bad_input", "bad inputs batched with good ones (predict raised)", FaultKind.MALFORMED_INPUT)
    faults.check(f"{kinds['refuse'] + kinds['crash']} bad of {len(everyone)}: every answer its own", not wrong)
    faults.record(
        tally,
        figure=f"{tally.n_answered} answered, {tally.n_refused} refused ({statuses[422]} x 422, {statuses[500]} x 500), "
        f"{tally.n_lost} lost, {len(wrong)} wrong; {len(calls)} predict calls, largest batch "
        f"{max((len(c['texts']) for c in calls), default=0)}, {len(mixed)} raised holding good inputs",
    )
    assert tally.sent == len(everyone)
    assert not wrong, wrong
    assert tally.n_lost == 0, tally.lost
    assert tally.answered == {"200": kinds["good"]}
    assert tally.refused == {"422 bad input": kinds["refuse"], "500 model failed on its input": kinds["crash"]}
    # they did share batches: batches holding good and bad inputs of several clients raised
    assert any(len(cs) >= 3 for cs in clients_in), calls[:20]
