"""OpenAI's error shape, one place for every OpenAI-compatible route (the LLMs' completions and
chat, ``/v1/embeddings``): ``{"error": {"message", "type", "param", "code"}}`` with the status
OpenAI answers, so a client written against OpenAI handles ours the same way. What the ``openai``
Python client raises for each status:

=======  ==========================  ==========================  ====================================
status   type                        code (examples)             ``openai`` raises
=======  ==========================  ==========================  ====================================
400      ``invalid_request_error``   ``invalid_value``,          ``BadRequestError``
                                     ``unsupported_parameter``,
                                     ``missing_required_parameter``,
                                     ``context_length_exceeded``
404      ``invalid_request_error``   ``model_not_found``         ``NotFoundError``
413/422  ``invalid_request_error``   ``body_too_large``,         ``APIStatusError`` /
                                     ``invalid_input``           ``UnprocessableEntityError``
503      ``server_error``            ``overloaded``              ``InternalServerError`` (retried)
500/504  ``server_error``            ``None``, ``timeout``       ``InternalServerError``
=======  ==========================  ==========================  ====================================

``param`` names the request field at fault (``max_tokens``, ``messages.0.role``, ``input[2]``);
a 503 carries ``Retry-After``. Pure: no Serve, no starlette.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ErrorType(StrEnum):
    INVALID_REQUEST = "invalid_request_error"  # the client's request is at fault: fix it, do not retry
    SERVER = "server_error"  # the server's side: overloaded, timed out or failed; retry may help


@dataclass(frozen=True)
class OpenAIError:
    """One error answer: its HTTP status and OpenAI's error object."""

    status: int
    message: str  # what is wrong and how to fix it
    type: ErrorType
    param: str | None = None  # the request field at fault
    code: str | None = None  # a machine-readable reason
    retry_after_s: int | None = None  # sent as Retry-After (overload)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": str(self.type), "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def reply(self) -> dict[str, Any]:
        """As plain data across a Ray call: ``{"status", "body", "headers"}``."""
        return {"status": self.status, "body": self.body(), "headers": self.headers()}


def invalid(param: str, message: str, code: str = "invalid_value", status: int = 400) -> OpenAIError:
    """The client's request is at fault at ``param``."""
    return OpenAIError(status, message, ErrorType.INVALID_REQUEST, param, code)


def unsupported(param: str, supported: Iterable[str]) -> OpenAIError:
    """A field OpenAI knows that this server does not honour: refused, never silently ignored."""
    names = ", ".join(sorted(supported))
    listed = f". Supported: {names}" if names else ""
    return invalid(
        param,
        f"{param}: is not supported by this server (it would be ignored); remove it{listed}",
        "unsupported_parameter",
    )


def model_not_found(name: str, known: Iterable[str], what: str = "model") -> OpenAIError:
    known_names = ", ".join(sorted(known)) or "none"
    return OpenAIError(
        404,
        f"model: the {what} '{name}' does not exist; known: {known_names}",
        ErrorType.INVALID_REQUEST,
        "model",
        "model_not_found",
    )


def overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    """The server refused the request unstarted for load (a full queue, a shed wait): 503, retry later."""
    return OpenAIError(503, message, ErrorType.SERVER, None, "overloaded", retry_after_s)


def server_error(message: str, status: int = 500, code: str | None = None) -> OpenAIError:
    return OpenAIError(status, message, ErrorType.SERVER, None, code)


def from_validation(errors: Sequence[Mapping[str, Any]], supported: Iterable[str]) -> OpenAIError:
    """The first of pydantic's ``ValidationError.errors()`` as a 400 naming its field: an unknown
    field is ``unsupported_parameter`` (listing ``supported``, the top level's fields), a missing
    one ``missing_required_parameter``."""
    err = errors[0]
    param = ".".join(str(p) for p in err["loc"]) or "body"
    if err["type"] == "extra_forbidden":  # the list names the top level's fields only
        return unsupported(param, supported if len(err["loc"]) == 1 else ())
    if err["type"] == "missing":
        return invalid(param, f"{param}: is required; add it", "missing_required_parameter")
    return invalid(param, f"{param}: {err['msg']} (got {err.get('input')!r})")
