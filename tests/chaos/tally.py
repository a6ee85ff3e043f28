"""Every request a chaos row sends, counted one way: ``sent = answered + refused + lost``.

``classify`` reads one answer (an HTTP status with its body, a ``httpx.Response``, a load
generator ``Record``, the replica's in-process result dict, or the exception a client raised
instead of an answer) and returns its ``Outcome``: the first rule of ``RULES`` that matches
names it. ``Tally`` counts what a row sent and how each request ended, by rule and status, and
``Tally.check`` raises ``CountError`` when the sum does not hold (a request sent and never
counted, or counted twice). ``docs/RELIABILITY.md`` has the same table for readers.

The rules, first match wins:

==============================  =========  ================================================
answer                          verdict    why
==============================  =========  ================================================
2xx                             answered   the model's output
no answer, client timeout       lost       the client gave up; nobody decided
no answer, connection error     lost       nothing came back (also: a request never sent)
503 "replica ... was lost"      lost       the replica died under it (the proxy says so)
408                             lost       Serve's proxy gave up (``broker.proxy_timeout_s``)
413, 422                        refused    bad input, refused naming the field
404                             refused    unknown model, refused naming the known ones
429                             refused    back-pressure: retry later
503, 504 with gpubroker's body  refused    shed on purpose: queue full, admission paused, held
                                           over its grant, past ``request_timeout_s`` or the
                                           SLO; the body says why and when to retry
507 with gpubroker's body       refused    enforcement: the input cannot run under the
                                           model's memory grant (the violator's own)
500 naming its own input        refused    the model raised on this request's own input (or
                                           returned what JSON cannot hold for it): its error,
                                           never another's; retrying will not help
any other 5xx                   lost       not the model's: a crash, a batch no input
                                           explains, a gateway, Serve's bare 500
any other status                lost       nothing in this table expects it
==============================  =========  ================================================

"gpubroker's body" is a JSON object with a ``detail`` (the load generator keeps only the first
200 characters of a body: a truncated ``{"detail": ...`` still counts as one).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

COUNTING = "sent=answered+refused+lost/v2"  # rows counted by this module carry it as "counting"
# the proxy middleware's detail when the replica under a request died (gpubroker.deployments.serve.http_proxy)
REPLICA_LOST_TEXT = "the replica serving this request was lost"
_OWN_ITEM = re.compile(r"failed on inputs?\b|returned outputs?\b|^(input|inputs\[|output|outputs\[)")
_FIELD = re.compile(r'"field"\s*:\s*"([^"]*)"')


class Verdict(StrEnum):
    ANSWERED = "answered"
    REFUSED = "refused"
    LOST = "lost"


class Rule(StrEnum):
    """One row of the table above; its value is the name a tally counts it under."""

    OUTPUT = "output"
    CLIENT_TIMEOUT = "client timeout"
    NO_ANSWER = "no answer"
    REPLICA_LOST = "replica lost"
    PROXY_TIMEOUT = "proxy timeout"
    BAD_INPUT = "bad input"
    UNKNOWN_MODEL = "unknown model"
    BACK_PRESSURE = "back-pressure"
    SHED = "shed"
    OVER_GRANT = "over its grant"
    OWN_INPUT_FAILED = "model failed on its input"
    NOT_THE_MODEL = "not the model's"
    UNEXPECTED = "unexpected status"


@dataclass(frozen=True)
class Answer:
    """What came back for one request, reduced to what the rules read."""

    status: int | None  # HTTP status; None: no answer at all
    detail: str | None = None  # gpubroker's JSON ``detail``; None when the body is not gpubroker's
    field: str | None = None  # the body's ``field`` (the input or output at fault), when it names one
    timed_out: bool = False  # no answer because the client's own timeout passed


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    rule: Rule
    status: int | None

    @property
    def key(self) -> str:
        """The name a tally counts it under: ``200``, ``503 shed``, ``client timeout``."""
        if self.verdict is Verdict.ANSWERED:
            return str(self.status)
        return str(self.rule) if self.status is None else f"{self.status} {self.rule}"


def _own_item(a: Answer) -> bool:
    return bool(_OWN_ITEM.search(a.field or "") or _OWN_ITEM.search(a.detail or ""))


def _is(*statuses: int) -> Callable[[Answer], bool]:
    return lambda a: a.status in statuses


RULES: tuple[tuple[Rule, Verdict, Callable[[Answer], bool]], ...] = (
    (Rule.OUTPUT, Verdict.ANSWERED, lambda a: a.status is not None and 200 <= a.status < 300),
    (Rule.CLIENT_TIMEOUT, Verdict.LOST, lambda a: a.status is None and a.timed_out),
    (Rule.NO_ANSWER, Verdict.LOST, lambda a: a.status is None),
    (Rule.REPLICA_LOST, Verdict.LOST, lambda a: a.status == 503 and REPLICA_LOST_TEXT in (a.detail or "")),
    (Rule.PROXY_TIMEOUT, Verdict.LOST, _is(408)),
    (Rule.BAD_INPUT, Verdict.REFUSED, _is(413, 422)),
    (Rule.UNKNOWN_MODEL, Verdict.REFUSED, _is(404)),
    (Rule.BACK_PRESSURE, Verdict.REFUSED, _is(429)),
    (Rule.SHED, Verdict.REFUSED, lambda a: a.status in (503, 504) and bool(a.detail)),
    (Rule.OVER_GRANT, Verdict.REFUSED, lambda a: a.status == 507 and bool(a.detail)),
    (Rule.OWN_INPUT_FAILED, Verdict.REFUSED, lambda a: a.status == 500 and _own_item(a)),
    (Rule.NOT_THE_MODEL, Verdict.LOST, lambda a: (a.status or 0) >= 500),
    (Rule.UNEXPECTED, Verdict.LOST, lambda a: True),
)


def _from_body(status: int, body: Any) -> Answer:
    """gpubroker's ``detail`` and ``field`` from a body: a dict, JSON text or bytes, or the
    load generator's first 200 characters of one."""
    if isinstance(body, bytes | bytearray):
        body = bytes(body).decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            if body.lstrip().startswith('{"detail"'):  # cut short: still gpubroker's JSON answer
                found = _FIELD.search(body)
                return Answer(status, body, found.group(1) if found else None)
            return Answer(status)
    if isinstance(body, Mapping) and isinstance(body.get("detail"), str) and body["detail"]:
        fld = body.get("field")
        return Answer(status, body["detail"], str(fld) if fld else None)
    return Answer(status)


def _from_exception(exc: BaseException) -> Answer:
    timeout_types: tuple[type[BaseException], ...] = (TimeoutError,)
    try:
        import httpx

        timeout_types += (httpx.TimeoutException,)
    except ImportError:  # pragma: no cover - httpx is a test dependency
        pass
    return Answer(None, timed_out=isinstance(exc, timeout_types))


def answer_of(answer: Any, body: Any = None) -> Answer:
    """One answer in any of the shapes the chaos tests hold, as an ``Answer``."""
    if isinstance(answer, Answer):
        return answer
    if isinstance(answer, BaseException):
        return _from_exception(answer)
    if isinstance(answer, int):
        return _from_body(answer, body)
    if isinstance(answer, Mapping):  # the replica's in-process result: {"status", "detail", "field", ...}
        return _from_body(int(answer.get("status", 500)), answer)
    if hasattr(answer, "status_code"):  # httpx.Response
        return _from_body(answer.status_code, answer.content)
    if hasattr(answer, "status") and hasattr(answer, "error"):  # bench.loadgen.Record
        if answer.status <= 0:  # 0: client timeout or connection error; -1: never sent
            return Answer(None, timed_out="timeout" in (answer.error or "").lower())
        return _from_body(answer.status, answer.error)
    raise TypeError(f"cannot classify {type(answer).__name__}: give a status, a response, a record or an exception")


def classify(answer: Any, body: Any = None) -> Outcome:
    """The outcome of one request: the first rule of ``RULES`` its answer matches."""
    a = answer_of(answer, body)
    rule, verdict = next((r, v) for r, v, matches in RULES if matches(a))
    return Outcome(verdict, rule, a.status)


class CountError(AssertionError):
    """A row's requests do not add up: sent != answered + refused + lost."""


@dataclass
class Tally:
    """What one row sent and how each request ended (answered by status, refused and lost by
    status and rule). ``sent`` is counted apart from the outcomes, so a request that was sent and
    never counted (or counted twice) makes ``check`` fail."""

    sent: int = 0
    answered: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)

    def send(self, n: int = 1) -> None:
        self.sent += n

    def add(self, answer: Any, body: Any = None) -> Outcome:
        """Count one request's outcome (its send is counted with ``send``)."""
        out = classify(answer, body)
        {Verdict.ANSWERED: self.answered, Verdict.REFUSED: self.refused, Verdict.LOST: self.lost}[out.verdict][
            out.key
        ] += 1
        return out

    def sent_and_add(self, answer: Any, body: Any = None) -> Outcome:
        """One request sent and its outcome, when the two are known together (a list of answers)."""
        self.send()
        return self.add(answer, body)

    def call(self, request: Callable[[], Any]) -> Any:
        """Send one request (``request()``, e.g. ``lambda: client.post(url, json=body)``) and count
        its outcome; an exception instead of an answer is counted (lost) and raised again."""
        self.send()
        try:
            answer = request()
        except Exception as exc:
            self.add(exc)
            raise
        self.add(answer)
        return answer

    async def acall(self, request: Awaitable[Any]) -> Any:
        """``call`` for an awaitable (the replica's ``infer`` in-process, an async client's post)."""
        self.send()
        try:
            answer = await request
        except Exception as exc:
            self.add(exc)
            raise
        self.add(answer)
        return answer

    @classmethod
    def of(cls, answers: Iterable[Any], sent: int) -> Tally:
        """``sent`` requests (known apart from the answers: a plan's length) and their answers."""
        t = cls(sent=sent)
        for a in answers:
            t.add(a)
        return t

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.sent + other.sent,
            self.answered + other.answered,
            self.refused + other.refused,
            self.lost + other.lost,
        )

    @property
    def counted(self) -> int:
        return self.n_answered + self.n_refused + self.n_lost

    @property
    def n_answered(self) -> int:
        return sum(self.answered.values())

    @property
    def n_refused(self) -> int:
        return sum(self.refused.values())

    @property
    def n_lost(self) -> int:
        return sum(self.lost.values())

    def check(self, row: str = "") -> Tally:
        """Raise ``CountError`` unless every request sent was counted once."""
        if self.sent != self.counted:
            raise CountError(
                f"{row or 'row'}: sent {self.sent} != answered {self.n_answered} + refused {self.n_refused} "
                f"+ lost {self.n_lost} ({self.counted}); {self.sent - self.counted:+d} unaccounted for: count "
                "every request where it is sent (Tally.send) and where it ends (Tally.add)"
            )
        return self

    def to_row(self) -> dict[str, Any]:
        """The row's request columns (what ``tests/chaos/report.py`` checks again)."""
        return {
            "counting": COUNTING,
            "sent": self.sent,
            "answered": self.n_answered,
            "refused": self.n_refused,
            "lost": self.n_lost,
            "answered_by": dict(sorted(self.answered.items())),
            "refused_by": dict(sorted(self.refused.items())),
            "lost_by": dict(sorted(self.lost.items())),
        }


def check_row(row: Mapping[str, Any]) -> None:
    """Raise ``CountError`` unless a written row adds up: its totals (sent = answered + refused +
    lost) and each total against its by-status counts. A row without ``counting`` was not counted
    by this module (an older definition, or a writer that bypassed it)."""
    name = str(row.get("nodeid") or row.get("test") or "row")
    if row.get("counting") != COUNTING:
        raise CountError(f"{name}: not counted as {COUNTING} (an old row: recount it with `make chaos`)")
    by = {k: sum(int(v) for v in (row.get(f"{k}_by") or {}).values()) for k in ("answered", "refused", "lost")}
    totals = {k: int(row.get(k, -1)) for k in ("answered", "refused", "lost")}
    if by != totals:
        raise CountError(f"{name}: totals {totals} differ from their counts by status {by}")
    if int(row.get("sent", -1)) != sum(totals.values()):
        raise CountError(f"{name}: sent {row.get('sent')} != answered + refused + lost = {sum(totals.values())}")
