"""The model API's HTTP rules as plain functions: body limits, body shape, result -> response.

No Serve, no Ray, no starlette: ``gpubroker.deployments.serve.http_model`` (the HTTP adapter in the replica
process) reads the request and calls these; unit tests call them directly.

``POST /v1/models/{name}/infer``  body ``{"inputs": [item, ...]}`` or ``{"input": item}``
    200 ``{"model", "outputs": [...], "latency_ms"}`` (``{"output": ...}`` for a single input)
    413 body over the model's ``max_body_bytes`` (Content-Length, then the bytes read, both
        checked before any JSON parsing)
    422 bad input: the detail names the field (``inputs[2].text``, ``input.image``, ``body``),
        from the replica's checks or an ``InputError`` the model's ``predict`` raised for this input
    500 the model failed on this request's own input (its batch split until the failing inputs ran
        alone: only they fail, each with its own error), or returned what JSON cannot hold (NaN
        or infinity, an object of no JSON shape): the detail names the item and the field
        (``outputs[1].score``); a failure no input explains names the exception's type only
    503 + ``Retry-After`` on back-pressure (queue full, admission paused)
    504 when a request waited past the model's ``request_timeout_s``
    507 an input that cannot run even alone under the model's memory grant

A model's outputs may be what ordinary PyTorch code returns: numpy scalars and arrays, torch
tensors, tuples, dataclasses, enums (``json_safe`` turns them into JSON values).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

JSON_TYPE = "application/json"


@dataclass(frozen=True)
class HttpAnswer:
    """One HTTP answer: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    def encoded(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class ParsedBody:
    """A body that passed the shape checks: the items, and whether it was ``{"input": ...}``."""

    inputs: list
    single: bool


def too_big(name: str, limit_bytes: int) -> HttpAnswer:
    return HttpAnswer(
        413,
        {
            "detail": f"body is over max_body_bytes ({limit_bytes} bytes) for model '{name}'; "
            "send fewer or smaller inputs"
        },
    )


def length_check(name: str, content_length: str | None, limit_bytes: int) -> HttpAnswer | None:
    """The Content-Length header against the limit (None: read the body)."""
    if content_length is None:
        return None
    try:
        n = int(content_length)
    except ValueError:
        return HttpAnswer(400, {"detail": f"Content-Length {content_length!r} is not a number"})
    return too_big(name, limit_bytes) if n > limit_bytes else None


def _field_error(fld: str, detail: str) -> HttpAnswer:
    return HttpAnswer(422, {"detail": detail, "field": fld})


def parse_body(body: bytes) -> ParsedBody | HttpAnswer:
    """``{"inputs": [...]}`` or ``{"input": ...}``, else a 422 naming the field."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _field_error("body", f'body: not valid JSON ({exc}); send {{"inputs": [...]}} or {{"input": ...}}')
    if not isinstance(doc, dict):
        return _field_error("body", "body: expected a JSON object with 'inputs' (a list) or 'input'")
    extra = sorted(set(doc) - {"inputs", "input"})
    if extra:
        return _field_error(extra[0], f"{extra[0]}: unknown field; send only 'inputs' (a list) or 'input'")
    if "inputs" in doc and "input" in doc:
        return _field_error("inputs", "inputs: send either 'inputs' (a list) or 'input' (one item), not both")
    if "inputs" in doc:
        inputs = doc["inputs"]
        if not isinstance(inputs, list) or not inputs:
            return _field_error("inputs", "inputs: expected a non-empty list of items")
        return ParsedBody(inputs, False)
    if "input" in doc:
        return ParsedBody([doc["input"]], True)
    return _field_error("inputs", 'inputs: required field is missing; send {"inputs": [...]} or {"input": ...}')


class OutputError(ValueError):
    """A model output JSON cannot hold: ``where`` names the item and the field (``outputs[1].score``)."""

    def __init__(self, where: str, message: str):
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}")


def json_safe(value: Any, where: str = "output") -> Any:
    """``value`` as plain JSON data: numpy scalars and arrays and torch tensors (anything with
    ``tolist()``), tuples and sets as lists, dataclasses and pydantic models as objects, enums
    as their value. NaN, infinity, or an object of none of these shapes raises ``OutputError``
    naming ``where`` and the path below it."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OutputError(where, f"{value} is not a JSON number; return a finite value or null")
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, enum.Enum):
        return json_safe(value.value, where)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_safe(getattr(value, f.name), f"{where}.{f.name}") for f in dataclasses.fields(value)}
    for method in ("tolist", "model_dump"):  # numpy and torch; pydantic
        fn = getattr(value, method, None)
        if callable(fn):
            data = fn() if method == "model_dump" else _tolist(value)
            return json_safe(data, where)
    raise OutputError(
        where,
        f"a {type(value).__name__} is not JSON; return numbers, strings, lists, dicts, numpy arrays, "
        "torch tensors or dataclasses",
    )


def _tolist(value: Any) -> Any:
    detach = getattr(value, "detach", None)  # a torch tensor that needs grad refuses tolist()
    return (detach() if callable(detach) else value).tolist()


def _outputs_json(outputs: list) -> list:
    """The outputs unchanged when JSON holds them as they are (the fast path), else converted."""
    try:
        json.dumps(outputs, allow_nan=False)
        return outputs
    except (TypeError, ValueError):
        return [json_safe(out, f"outputs[{i}]") for i, out in enumerate(outputs)]


def answer_for(name: str, result: dict[str, Any], single: bool, retry_after_s: int) -> HttpAnswer:
    """The replica's ``infer`` result (a dict with an HTTP-like ``status``) as an HTTP answer."""
    status = int(result.get("status", 500))
    if status == 200:
        try:
            outputs = _outputs_json(list(result["outputs"]))
        except OutputError as exc:
            where = exc.where.replace("outputs[0]", "output", 1) if single else exc.where
            return HttpAnswer(
                500,
                {"detail": f"model '{name}' returned {where}: {exc.message} (fix the model's predict)", "field": where},
            )
        if single:
            return HttpAnswer(200, {"model": name, "output": outputs[0], "latency_ms": result.get("latency_ms")})
        return HttpAnswer(200, {"model": name, "outputs": outputs, "latency_ms": result.get("latency_ms")})
    body = {k: v for k, v in result.items() if k not in ("status", "retry_after_s")}
    if single and "field" in body:
        body["field"] = str(body["field"]).replace("inputs[0]", "input")
        body["detail"] = str(body["detail"]).replace("inputs[0]", "input")
        body.pop("errors", None)  # one input: its one error is the answer
    headers = {"Retry-After": str(result.get("retry_after_s", retry_after_s))} if status == 503 else {}
    return HttpAnswer(status, body, headers)


def not_found(path: str) -> HttpAnswer:
    return HttpAnswer(404, {"detail": f"no route {path}; models answer POST /v1/models/<name>/infer"})


def method_not_allowed(method: str) -> HttpAnswer:
    return HttpAnswer(405, {"detail": f"method {method} not allowed; send POST"}, {"Allow": "POST"})


def llm_on_batch_route(name: str) -> HttpAnswer:
    """The answer to ``POST /v1/models/<llm>/infer``: a 400 naming the OpenAI route an LLM answers on."""
    return HttpAnswer(
        400,
        {
            "detail": f"model '{name}' is an LLM: POST /openai/v1/completions or /openai/v1/chat/completions with "
            f'"model": "{name}" (an OpenAI client: base_url <fleet url>/openai/v1)',
            "field": "model",
        },
    )
