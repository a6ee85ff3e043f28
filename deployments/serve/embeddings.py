"""``POST /v1/embeddings`` in OpenAI's shape, over the fleet's request models that embed.

A model embeds when it defines ``embedding_input(text)`` (``gpubroker.deployments.models.protocol``;
the built-in ``minilm`` does). The fleet API (``gpubroker.deployments.serve.ingress``) reads the
body, checks it here, and hands the texts to one of the model's replicas (``HttpModel.embed``),
which sends them through the path ``/v1/models/<name>/infer`` takes: admission (body size, queue,
paused), the model's own validation, the broker-sized batches. Here too the answer is built.

Request  ``{"model", "input": str | [str, ...], "encoding_format": "float" | "base64", "user"}``
Response ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}``; ``base64`` is each vector's float32 bytes, little
endian, as OpenAI sends them. ``usage`` counts the model's tokens when it is token-priced
(``cost_unit: tokens``), else 0. Errors are OpenAI's (``openai_errors``): a bad body 400 naming the
field (``dimensions`` and other fields it would ignore: ``unsupported_parameter``), an unknown model
404, an LLM or a model that does not embed 400 (``param: model``), and the replica's own refusals
with their statuses: 413 body over ``max_body_bytes``, 422 an input the model refuses (``param:
input[i]``), 503 + ``Retry-After`` overloaded, 504 late, 507 over the grant.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpubroker.deployments.serve.openai_errors import (
    OpenAIError,
    from_validation,
    invalid,
    model_not_found,
    overloaded,
    server_error,
)
from gpubroker.quotas.config import FleetConfig

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


class EmbeddingsBody(BaseModel):
    # OpenAI's fields this route honours; any other is refused with a 400 naming it, never ignored
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] = Field(description="A text, or a list of texts (each embedded on its own).")
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(None, description="The caller's end-user id, for its own records: accepted, not used.")


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A body that passed the checks: the model, its texts in order, the encoding."""

    model: str
    texts: list[str]
    encoding_format: str
    single: bool  # ``input`` was one string, not a list


def parse_embeddings(raw: bytes, cfg: FleetConfig) -> EmbeddingsRequest | OpenAIError:
    """The body checked against OpenAI's fields and the fleet's models (not yet whether the model
    embeds: its replica knows that)."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return invalid("body", f'body: not valid JSON ({exc}); send {{"model": ..., "input": ...}}')
    if not isinstance(doc, dict):
        return invalid("body", "body: must be a JSON object")
    try:
        body = EmbeddingsBody.model_validate({k: v for k, v in doc.items() if v is not None})
    except ValidationError as exc:
        return from_validation(exc.errors(), sorted(EmbeddingsBody.model_fields))
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts or len(texts) > MAX_INPUTS:
        return invalid("input", f"input: send 1 to {MAX_INPUTS} texts (got {len(texts)})")
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        where = "input" if isinstance(body.input, str) else f"input[{empty}]"
        return invalid(where, f"{where}: is empty; send at least one character")
    spec = cfg.models.get(body.model)
    if spec is None:
        return model_not_found(body.model, cfg.models)
    if spec.kind == "llm":
        return not_an_embedder(body.model, "is an LLM (it completes text; POST /openai/v1/completions)")
    return EmbeddingsRequest(body.model, texts, body.encoding_format, isinstance(body.input, str))


def not_an_embedder(name: str, why: str) -> OpenAIError:
    return invalid("model", f"model: '{name}' {why}; /v1/embeddings takes a model that embeds", "model_not_embedding")


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the numbers; ``base64``: their float32 bytes, little endian (OpenAI's encoding)."""
    if encoding_format != "base64":
        return vector
    packed = struct.pack(f"<{len(vector)}f", *vector)
    return base64.b64encode(packed).decode("ascii")


def embeddings_body(req: EmbeddingsRequest, vectors: list[list[float]], prompt_tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": req.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


_ITEM = re.compile(r"inputs\[(\d+)\](\.\S+)?")


def input_param(field: str | None, single: bool) -> str:
    """The replica's field (``inputs[2].text``) as the request's (``input[2]``; ``input`` for one string)."""
    found = _ITEM.match(field or "")
    if found is None:
        return "input"
    return "input" if single else f"input[{found.group(1)}]"


def replica_error(req: EmbeddingsRequest, result: dict[str, Any]) -> OpenAIError:
    """A replica's refusal (``ModelReplica.infer``'s error dict, or ``HttpModel.embed``'s) in OpenAI's shape."""
    status = int(result.get("status", 500))
    detail = str(result.get("detail") or f"model '{req.model}' failed the request")
    if status == 400 and result.get("field") == "model":
        return not_an_embedder(req.model, "does not embed text (its class has no embedding_input)")
    if status == 413:
        return invalid("input", detail, "body_too_large", 413)
    if status == 422:
        param = input_param(result.get("field"), req.single)
        return invalid(param, re.sub(r"inputs\[\d+\](\.text)?", param, detail), "invalid_input", 422)
    if status == 503:
        return overloaded(detail, int(result.get("retry_after_s") or 1))
    if status == 504:
        return server_error(detail, 504, "timeout")
    if status == 507:
        return server_error(detail, 507, "insufficient_memory")
    return server_error(detail, status if status >= 500 else 500)


def too_large(limit_bytes: int) -> OpenAIError:
    return invalid(
        "input",
        f"body: over every model's max_body_bytes ({limit_bytes} bytes); send fewer or shorter texts",
        "body_too_large",
        413,
    )


def body_limit(cfg: FleetConfig) -> int:
    """The most bytes an embeddings body may have: the largest ``max_body_bytes`` of a request
    model (the model's own limit is checked again by its replica)."""
    limits = [int(m.max_body_bytes) for m in cfg.models.values() if m.kind != "llm"]
    return max(limits, default=0)
