"""The OpenAI formats: requests (pydantic models), responses, stream chunks and error bodies.

Fields d2o does not know are ignored, as OpenAI's own server ignores what it does not know; those
of OpenAI's that would change the answer and that d2o does not implement are refused
(``NOT_SUPPORTED``). Two extension fields choose the cache per request: ``kv_method`` and
``kv_budget``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


NULL_IS_DEFAULT = ("temperature", "top_p", "top_k", "n", "stream")
# Fields of OpenAI's API that change the answer and that this server does not implement, with the
# values that ask for nothing (null too): anything else is refused, not ignored, since the client
# would take the answer for one that honours them.
NOT_SUPPORTED = {"logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "logit_bias": ({},),
                 "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "best_of": (1,),
                 "suffix": ("",), "response_format": ({"type": "text"},), "tools": ([],),
                 "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto")}


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False


class Generation(BaseModel):
    """What both endpoints share: sampling, limits, stop strings, and d2o's cache fields."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1 (vLLM's "off"): every token
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # what a torch generator takes
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    kv_method: Optional[str] = None
    kv_budget: Union[StrictInt, StrictFloat, StrictStr, None] = None  # strict: true is not a budget of 1
    off_values: ClassVar[dict] = NOT_SUPPORTED  # per endpoint: what asks for nothing differs
    # Not supported (see NOT_SUPPORTED): any value, so the refusal names the field whatever its type.
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body):
        """OpenAI takes null for these (clients send it for "not set"): the default, then."""
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return body

    @field_validator(*NOT_SUPPORTED)
    @classmethod
    def _not_supported(cls, value, info):
        if value is not None and value not in cls.off_values[info.field_name]:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_streamed(cls, options, info):
        if options is not None and options.include_usage and not info.data.get("stream"):
            raise ValueError("stream_options.include_usage is only allowed with stream: true (a whole "
                             "answer carries its usage)")
        return options

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n}: one choice per request is supported (n=1)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None

    def as_turn(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class CompletionRequest(Generation):
    prompt: Union[str, list[str]]

    # Completions return the sampled token's log probability for logprobs=0: only null asks for none.
    off_values: ClassVar[dict] = {**NOT_SUPPORTED, "logprobs": ()}

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError(f"{len(prompt)} prompts: one prompt per request is supported")
            return prompt[0]
        return prompt


# -- responses ----------------------------------------------------------------------------------
CHAT, TEXT = "chat.completion", "text_completion"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex[:24]


def usage(result) -> dict:
    """Token counts (the prompt's tokens found compressed in the prefix cache as OpenAI reports
    cached tokens), and what the request's cache held when it finished (its share of a batch's
    tensors) against what a full cache would have held."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        "kv_tokens": result.kv_tokens,
        "kv_tokens_full": result.kv_tokens_full,
        "kv_bytes": result.kv_bytes,
        "kv_bytes_full": result.kv_bytes_full,
    }


def _envelope(kind: str, rid: str, model: str, choice: dict, chunk: bool) -> dict:
    obj = kind + ".chunk" if chunk and kind == CHAT else kind
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def response(kind: str, rid: str, model: str, text: str, result, kv: dict) -> dict:
    """A whole (non-streamed) answer."""
    content = {"message": {"role": "assistant", "content": text}} if kind == CHAT else {"text": text}
    choice = {"index": 0, **content, "finish_reason": result.finish_reason, "logprobs": None}
    return {**_envelope(kind, rid, model, choice, chunk=False), "usage": usage(result), **kv}


def chunk(kind: str, rid: str, model: str, text: str | None, finish_reason: str | None = None,
          first: bool = False) -> dict:
    """One server-sent event of a stream: a piece of text, or the end (``finish_reason``)."""
    if kind == CHAT:
        delta = {} if text is None else {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return _envelope(kind, rid, model, choice, chunk=True)


def usage_chunk(kind: str, rid: str, model: str, result) -> dict:
    return {**_envelope(kind, rid, model, {}, chunk=True), "choices": [], "usage": usage(result)}
