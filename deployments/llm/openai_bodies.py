"""OpenAI's response bodies from engine token streams: choices, logprobs, stream chunks, usage.

``LlmServer`` runs the engine and hands the pieces here; these functions only shape them, in the
two shapes OpenAI gives them:

- completions (``text_completion``): a choice is ``{"index", "text", "logprobs", "finish_reason"}``,
  its ``logprobs`` ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``;
- chat (``chat.completion``): a choice is ``{"index", "message": {"role", "content"}, "logprobs",
  "finish_reason"}``, its ``logprobs`` ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}]}``; a stream chunk carries ``delta`` instead of ``message``.

With ``stream_options.include_usage`` every chunk carries ``"usage": null`` and one last chunk,
with no choices, carries the usage (as OpenAI sends it). Pure: no engine, no Serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpubroker.deployments.llm.engine import FinishReason, TokenDelta, TokenLogprob

COMPLETION, CHAT = "completion", "chat"
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # anything else ends as "error"


@dataclass
class Choice:
    """One choice's stream gathered whole (a request with ``n`` has ``n``)."""

    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: TokenDelta = field(default_factory=lambda: TokenDelta(()))

    def add(self, delta: TokenDelta) -> None:
        self.tokens.extend(delta.token_ids)
        self.pieces.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.last = delta

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def finish_reason(delta: TokenDelta) -> str | None:
    return FINISH.get(delta.finish_reason, "error") if delta.finished and delta.finish_reason else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: one entry per token, each with its ``top_logprobs``."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _utf8(e.token),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs``; ``text_offset`` counts characters of the generated text from ``offset``."""
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def logprobs_of(kind: str, entries: Sequence[TokenLogprob], wanted: bool, offset: int = 0) -> dict[str, Any] | None:
    if not wanted:
        return None
    return chat_logprobs(entries) if kind == CHAT else completion_logprobs(entries, offset)


def whole_choices(kind: str, choices: Sequence[Choice], want_logprobs: bool) -> list[dict[str, Any]]:
    """The ``choices`` of a whole (not streamed) answer, ``index`` in submission order."""
    out = []
    for i, c in enumerate(choices):
        reason = finish_reason(c.last) or "length"
        lp = logprobs_of(kind, c.logprobs, want_logprobs)
        if kind == CHAT:
            out.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            )
        else:
            out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": reason})
    return out


def chunk_choice(kind: str, index: int, delta: TokenDelta, want_logprobs: bool, offset: int) -> dict[str, Any] | None:
    """One stream chunk's choice for ``delta`` of choice ``index`` (None: nothing to send)."""
    reason = finish_reason(delta)
    if not delta.text and reason is None and not delta.logprobs:
        return None
    lp = logprobs_of(kind, delta.logprobs, want_logprobs, offset)
    if kind == CHAT:
        content = {"content": delta.text} if delta.text else {}
        return {"index": index, "delta": content, "logprobs": lp, "finish_reason": reason}
    return {"index": index, "text": delta.text, "logprobs": lp, "finish_reason": reason}


def role_choice(index: int) -> dict[str, Any]:
    """A chat stream's first chunk of each choice: the assistant's role, no content yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
