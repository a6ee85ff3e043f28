"""OpenAI-compatible HTTP API for the fleet's LLMs (``kind: llm`` models), on Ray Serve.

``POST /v1/completions``       ``{"model", "prompt": str | [ids], "max_tokens", "logprobs": int, ...}``
``POST /v1/chat/completions``  ``{"model", "messages": [{"role", "content"}], "max_completion_tokens",
                               "logprobs": bool, "top_logprobs", ...}``
    both also take ``n``, ``seed``, ``stop``, ``temperature``, ``top_p``, ``presence_penalty``,
    ``frequency_penalty``, ``stream``, ``stream_options.include_usage``, ``user`` (accepted, not
    used); any other field is refused (400 ``unsupported_parameter`` naming it), never ignored.
    (chat prompts go through the model's chat template; each engine is vLLM, ``gpubroker.deployments.llm.vllm_engine``)
    200 an OpenAI ``text_completion`` / ``chat.completion``; with ``stream: true`` server-sent
        events (``data: {chunk}``) ending in ``data: [DONE]``
    400 an OpenAI error (``gpubroker.deployments.serve.openai_errors``) whose ``param`` names the
        field: a bad body, or a prompt plus ``max_tokens`` over the context (``context_length_exceeded``)
    404 an unknown ``model`` (``model_not_found``; the message names the known ones)
    503 + ``Retry-After`` a request the engine shed unstarted (``overloaded``: it waited for
        admission past the model's ``max_queue_wait_ms``)
``GET /v1/models``               the LLMs, OpenAI-style
``GET /v1/llm/{model}/stats``    the engine's report (bounds, KV blocks, TTFT/TPOT percentiles)

``model`` picks the fleet model; each LLM is its own ``LlmServer`` deployment. Closing a
stream cancels its sequence (Serve cancels the replica's generator, which cancels the
engine's request). Build with ``build_llm_app({"config": "configs/llm-demo.yaml"})``.
"""

# no "from __future__ import annotations": FastAPI must see the real Request annotation

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray import serve
from ray.serve import Application

from gpubroker.deployments.llm.openai_bodies import CHAT, COMPLETION
from gpubroker.deployments.llm.server import LlmServer
from gpubroker.deployments.serve.openai_errors import OpenAIError, from_validation, invalid, model_not_found
from gpubroker.deployments.serve.versions import code_digest, deployment_version

if TYPE_CHECKING:
    from gpubroker.quotas.config import FleetConfig

api = FastAPI(title="gpubroker LLMs", description="OpenAI-compatible completions on the fleet's LLM engines.")

LLM_NUM_CPUS = 0.2
INGRESS_NUM_CPUS = 0.05
MAX_CHOICES = 128  # OpenAI's bound on n


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="A last chunk with the usage and no choices, before [DONE].")


class _Body(BaseModel):
    # OpenAI's fields this server honours; any other is refused with a 400 naming it, never ignored
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate; default 16 (completions), 64 (chat).")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate (vLLM's n: one sequence each).")
    seed: int | None = Field(None, description="vLLM's seed: the same seed, prompt and parameters, the same text.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(
        None, description="Up to 4 strings that end the generation (left out of the text)."
    )
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = Field(None, description="The caller's end-user id, for its own records: accepted, not used.")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else list(value or [])
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("must be up to 4 non-empty strings")
        return value


class CompletionBody(_Body):
    prompt: str | list[int]
    logprobs: int | None = Field(
        None, ge=0, le=5, description="The log-probability of each token and of the N likeliest at its place."
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's current name for max_tokens.")
    logprobs: bool = Field(False, description="The log-probability of each token of the answer.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: the N likeliest tokens at each place."
    )


def _fields(schema: type[BaseModel]) -> list[str]:
    return sorted(schema.model_fields)


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content=err.body(), headers=err.headers() or None)


def _reply(out: dict[str, Any]) -> JSONResponse:
    """A server's answer (``{"status", "body", "headers"?}``) as the HTTP response."""
    return JSONResponse(status_code=out["status"], content=out["body"], headers=out.get("headers") or None)


def parse_body(kind: str, raw: Any) -> tuple[dict[str, Any] | None, JSONResponse | None]:
    """A validated body as a plain dict for ``LlmServer`` (``max_tokens`` filled in and the field
    it came from in ``max_tokens_param``; ``logprobs``: the top logprobs per token, or None;
    ``include_usage``), or a 400 naming the field. A field sent as null counts as not sent."""
    schema: type[_Body] = ChatBody if kind == CHAT else CompletionBody
    given = {k: v for k, v in raw.items() if v is not None}
    try:
        body = schema.model_validate(given)
    except ValidationError as exc:
        return None, _error(from_validation(exc.errors(), _fields(schema)))
    if body.stream_options is not None and not body.stream:
        return None, _error(invalid("stream_options", "stream_options: only with stream: true; drop it or stream"))
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        return None, _error(invalid("top_logprobs", "top_logprobs: needs logprobs: true; set it or drop top_logprobs"))
    out = body.model_dump(exclude={"stream_options", "user"})
    out["include_usage"] = bool(body.stream_options and body.stream_options.include_usage)
    if isinstance(body, ChatBody):
        out["messages"] = [m.model_dump() for m in body.messages]
        out["max_tokens_param"] = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        out["max_tokens"] = body.max_completion_tokens or body.max_tokens or 64  # vLLM's order
        out["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        out.pop("top_logprobs"), out.pop("max_completion_tokens")
    else:
        out["max_tokens_param"] = "max_tokens"
        out["max_tokens"] = body.max_tokens or 16
        if isinstance(body.prompt, str) and not body.prompt:
            return None, _error(invalid("prompt", "prompt: is empty; send at least one character"))
    return out, None


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, handles: dict[str, Any]):
        self.handles = handles

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "gpubroker"} for n in sorted(self.handles)],
        }

    @api.get("/v1/llm/{name}/stats")
    async def stats(self, name: str) -> JSONResponse:
        handle = self.handles.get(name)
        if handle is None:
            return _error(model_not_found(name, self.handles, "LLM"))
        return JSONResponse(await handle.report.remote())

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(COMPLETION, request)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(CHAT, request)

    async def _serve(self, kind: str, request: Request):
        try:
            raw = await request.json()
        except ValueError:
            return _error(invalid("body", "body: not JSON; send a JSON object"))
        if not isinstance(raw, dict):
            return _error(invalid("body", "body: must be a JSON object"))
        body, err = parse_body(kind, raw)
        if err is not None:
            return err
        handle = self.handles.get(body["model"])
        if handle is None:
            return _error(model_not_found(body["model"], self.handles, "LLM"))
        if not body["stream"]:
            return _reply(await handle.generate.remote(kind, body))
        gen = handle.options(stream=True).generate_stream.remote(kind, body)
        head = await gen.__anext__()
        if head["status"] != 200:
            gen.cancel()
            return _reply(head)

        async def events():
            try:
                async for chunk in gen:
                    yield chunk
            finally:
                gen.cancel()  # the client went away (or we are done): the replica cancels the sequence

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# where one LLM engine runs: its card ("" in a one-card fleet) and its Ray actor options
EngineSpot = tuple[str, dict[str, Any]]


def build_llm_fleet(
    llms: dict[str, dict[str, Any]],
    llm_num_cpus: float = LLM_NUM_CPUS,
    *,
    cfg: "FleetConfig | None" = None,
    config_text: str = "",
    spots: Mapping[str, EngineSpot] | None = None,
) -> Application:
    """The ingress and one ``LlmServer`` deployment per LLM (name -> engine options). With the
    fleet's ``cfg`` (typed; each server gets it) each server reports to the broker and runs the
    bounds it sets; ``config_text`` is that config's text, hashed into each version, not parsed.
    ``spots``: each engine's card and Ray options (``llm_spots``; default: ``num_cpus`` only, no card).

    Every deployment carries a version from what it runs (``gpubroker.deployments.serve.versions``: its options,
    arguments and gpubroker's own code), so deploying the app again after a re-placement
    (``gpubroker.deployments.serve.reconcile``) restarts only the engines that moved; the others and the ingress
    keep running. New code is a new version everywhere."""
    code = code_digest()
    handles = {}
    for name, options in llms.items():
        card_id, actor_options = (spots or {}).get(name) or ("", {"num_cpus": llm_num_cpus})
        dep_name = f"llm-{name}"
        args = (name, options, cfg, card_id)
        version = deployment_version(
            LlmServer,
            dep_name,
            1,
            actor_options,
            (name, json.dumps(options, sort_keys=True), config_text, card_id),
            code,
        )
        handles[name] = (
            serve.deployment(LlmServer)
            .options(
                name=dep_name,
                num_replicas=1,
                max_ongoing_requests=1024,
                ray_actor_options=actor_options,
                health_check_period_s=5,
                graceful_shutdown_timeout_s=5,
            )
            .options(version=version, _internal=True)  # Serve's own option; not settable otherwise
            .bind(*args)
        )
    ingress_options = {"num_cpus": INGRESS_NUM_CPUS}
    ingress_version = deployment_version(
        OpenAIIngress.func_or_class, "llm-ingress", 1, ingress_options, tuple(sorted(handles)), code
    )
    return (
        OpenAIIngress.options(name="llm-ingress", ray_actor_options=ingress_options, max_ongoing_requests=4096)
        .options(version=ingress_version, _internal=True)
        .bind(handles)
    )


def llm_spots(placement: Any, llm_num_cpus: float = LLM_NUM_CPUS) -> dict[str, EngineSpot]:
    """Each LLM engine's card and Ray options under a deploy-time ``gpubroker.quotas.placement.Placement``,
    as a batch model's replica gets them (``gpubroker.deployments.serve.placement_resources``): on a fleet of
    several cards the card's custom resource (its share of the card's processes), ``num_gpus``
    and ``CUDA_VISIBLE_DEVICES`` on CUDA, the card in its environment and in its reports; on the
    one card of a ``gpu:`` fleet, ``num_cpus`` only."""
    from gpubroker.deployments.serve.placement_resources import deployment_plans

    many = len(placement.cards) > 1
    return {
        plan.model: (plan.card_id if many else "", plan.ray_actor_options)
        for plan in deployment_plans(placement, model_num_cpus=llm_num_cpus)
    }


def build_llm_app(args: dict[str, Any]) -> Application:
    """Serve builder: ``{"config": path}`` or ``{"config_text": yaml}``; serves its ``kind: llm`` models.
    The text arrives here from outside (``serve deploy``'s args): parsed once, the typed config passed on."""
    from gpubroker.quotas.config import parse_config_text

    text = _config_text(args)
    cfg = parse_config_text(text, str(args.get("config", "config_text")))
    return llm_app(cfg, text, float(args.get("llm_num_cpus", LLM_NUM_CPUS)))


def _config_text(args: dict[str, Any]) -> str:
    """The fleet YAML from ``config_text``, or from the ``config`` path (tried against the project
    root too: ``serve deploy`` builds apps in a worker outside the checkout)."""
    if args.get("config_text"):
        return str(args["config_text"])
    given = Path(str(args.get("config") or ""))
    for path in (given, Path(__file__).resolve().parents[2] / given):
        if str(given) not in ("", ".") and path.is_file():
            return path.read_text(encoding="utf-8")
    raise ValueError(
        f"build_llm_app args: config {args.get('config')!r} is not a file; pass config "
        "(a fleet YAML path) or config_text (the YAML itself)"
    )


def llm_app(
    cfg: "FleetConfig",
    config_text: str,
    llm_num_cpus: float = LLM_NUM_CPUS,
    placement: Any = None,
    spots: Mapping[str, EngineSpot] | None = None,
) -> Application:
    """The fleet's LLM application (``gpubroker.deployments.app.fleet_apps`` routes it at ``/openai``):
    the OpenAI ingress and one reporting ``LlmServer`` per ``kind: llm`` model. With the fleet's
    ``placement`` (``gpus:``) each engine runs on its placed card (``llm_spots``); ``spots`` gives
    them outright (a re-placement: ``gpubroker.deployments.serve.reconcile``). ``config_text``: the
    text ``cfg`` was parsed from, for the deployments' versions only."""
    llms = {name: dict(spec.options) for name, spec in cfg.models.items() if spec.kind == "llm"}
    if not llms:
        raise ValueError("models: no model has kind: llm; add one (model: tiny-llama, kind: llm) to serve completions")
    if spots is None and placement is not None:
        spots = {n: s for n, s in llm_spots(placement, llm_num_cpus).items() if n in llms}
    return build_llm_fleet(llms, llm_num_cpus, cfg=cfg, config_text=config_text, spots=spots)
