"""Requests as pydantic models (known fields type-checked; OpenAI fields entmtp does not implement refused with a
400 naming them unless they hold their no-op value; other unknown fields ignored, as OpenAI's API does) and the
OpenAI response shapes: chat.completion(.chunk), text_completion, error."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..accept import GREEDY_BELOW
from ..records import MAX_TOP_LOGPROBS  # chat's top_logprobs, as OpenAI's

DEFAULT_MAX_TOKENS = 256  # when a request gives none (never past the context window)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI's

# OpenAI request fields entmtp does not implement, with the values that ask for nothing (clients such as
# LangChain send some of these by default): any other value is a 400 naming the field, never a silent no-op.
UNSUPPORTED: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


def unsupported(data: dict) -> tuple[str, str] | None:
    """(message, field) for the first field of a request body that asks for something entmtp does not do."""
    for name, no_op in UNSUPPORTED.items():
        if name in data and not any(type(data[name]) is type(v) and data[name] == v for v in no_op):
            allowed = " or ".join(json.dumps(v) for v in no_op)
            return (
                f"{name} is not supported by entmtp: leave it out (or send {allowed}); "
                "the request would otherwise not do what it asks",
                name,
            )
    return None


def _valid_unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start : e.end].encode("unicode_escape").decode()
        raise ValueError(
            f"contains {bad} at character {e.start}, a lone surrogate that is not valid Unicode: "
            "send text as UTF-8 (a surrogate pair must be complete)"
        ) from None
    return s


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str

    _unicode = field_validator("text")(_valid_unicode)


class _Content(BaseModel):
    """A `content` of text or text parts (OpenAI's two spellings), valid Unicode, read as one text."""

    content: str | list[ContentPart]

    @field_validator("content")
    @classmethod
    def _unicode(cls, v):
        return _valid_unicode(v) if isinstance(v, str) else v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """An earlier assistant turn's call (its text is written back into the prompt: tools.history)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Content):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (an assistant's may have tool_calls instead)")
        return self

    def text(self) -> str:
        return "" if self.content is None else super().text()

    def rendered(self) -> dict:
        """What the chat template reads (tools.history writes calls and their results as text)."""
        calls = [c.function.model_dump() for c in self.tool_calls or []]
        return {"role": self.role, "content": self.text(), "tool_calls": [{"function": c} for c in calls]}


class Prediction(_Content):
    """OpenAI's Predicted Outputs: the output the client expects, as drafts (entmtp/prediction.py)."""

    model_config = ConfigDict(extra="forbid")  # a field entmtp does not know is a 400, not a silent no-op
    type: Literal["content"]


class _Params(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int | None = Field(None, ge=1, le=1)
    prediction: Prediction | None = None
    # checked where they are used (a 400 naming the field): constraints.py, penalties.py
    response_format: dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @field_validator("temperature")
    @classmethod
    def _greedy_below(cls, v):
        """A temperature under GREEDY_BELOW is greedy decoding (accept.Sampling's rule): sent on as 0."""
        return 0.0 if v is not None and v < GREEDY_BELOW else v

    @field_validator("top_p")
    @classmethod
    def _full_distribution(cls, v):
        if v is not None and v < 1.0:
            raise ValueError("top_p < 1 is not supported: entmtp samples the full distribution (lossless)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return [_valid_unicode(s) for s in stops] or None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Params):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None  # checked by tools.Tools.of (a 400 naming tools or tool_choice)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_k(self) -> int | None:
        """Engine.stream's `logprobs`: top tokens per position (None: no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Params):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @property
    def top_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty: give some text or token ids to continue")
        return _valid_unicode(v) if isinstance(v, str) else v


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first problem of a pydantic error as (message, param)."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    return f"{param}: {msg}" if param else msg, param


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str, calls=None) -> str:
    if calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"  # eos and stop strings both end as "stop"


def usage(result) -> dict:
    n = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": result.prompt_tokens + n,
        "entmtp": {  # extras: speculative decoding's own numbers
            "steps": result.num_steps,
            "tokens_per_step": result.mean_tokens_per_step,
            "tokens_per_second": result.tokens_per_second,
            "acceptance": result.acceptance,  # greedy | sample, gumbel (lossless) | typical (not lossless)
            "drafts": result.drafts.to_json(),  # drafted and accepted nodes by source (drafts.py)
        },
    } | _prediction_details(result.prediction)


def _prediction_details(used) -> dict:
    """OpenAI's completion_tokens_details of a request with a prediction (prediction.PredictionUsage)."""
    if used is None:
        return {}
    details = {"accepted_prediction_tokens": used.accepted, "rejected_prediction_tokens": used.rejected}
    return {"completion_tokens_details": {"reasoning_tokens": 0, **details}}


def _envelope(rid: str, model: str, obj: str, choices: list[dict], **extra) -> dict:
    """What every response and chunk carries: id, object, created, model, choices (and usage)."""
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (printable bytes stand for themselves, the others
    for 256 + n): how a byte-level token's string spells its exact bytes, even half a UTF-8 character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], n = chr(256 + n), n + 1
    return {c: b for b, c in chars.items()}


class TokenText:
    """A token id's text and bytes, as OpenAI's logprobs report them (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.byte_of, self._cache = tokenizer, _byte_level(), {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self.tokenizer.decode([token_id])  # special tokens spelled out, as OpenAI does
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if piece and all(c in self.byte_of for c in piece):  # byte-level BPE: the exact bytes
                raw = [self.byte_of[c] for c in piece]
            else:
                raw = list(text.encode("utf-8"))
            self._cache[token_id] = (text, raw)
        return self._cache[token_id]


def logprobs(
    chat: bool, items, token_text: TokenText, offset: int = 0, byte_budget: int | None = None
) -> dict | None:
    """OpenAI's `logprobs` of a choice for `items` (TokenLogprob ...): chat's {"content": [...]} or
    completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; `offset`: characters before.
    `byte_budget`: the bytes of text these tokens write (a reply cut by a stop string): the token that
    reaches into the stop string is cut where the text ends, as OpenAI reports it."""
    if items is None:
        return None
    pieces = [token_text(item.token_id) for item in items]  # (text, bytes) per token
    if byte_budget is not None:
        pieces = _clipped(pieces, byte_budget)
        items = items[: len(pieces)]
    if chat:
        content = []
        for item, (text, raw) in zip(items, pieces, strict=True):
            top = [
                {"token": token_text(t)[0], "logprob": lp, "bytes": token_text(t)[1]} for t, lp in item.top
            ]
            content.append({"token": text, "logprob": item.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}
    texts = [text for text, _ in pieces]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [item.logprob for item in items],
        "top_logprobs": [{token_text(t)[0]: lp for t, lp in item.top} for item in items],
        "text_offset": offsets,
    }


def _clipped(pieces: list[tuple[str, list[int]]], budget: int) -> list[tuple[str, list[int]]]:
    """The (text, bytes) pieces of tokens cut to `budget` bytes in all: the last one kept ends there."""
    out = []
    for text, raw in pieces:
        if budget <= 0:
            break
        if len(raw) > budget:
            raw = raw[:budget]
            text = bytes(raw).decode("utf-8", errors="replace")
        out.append((text, raw))
        budget -= len(raw)
    return out


def stop_budget(result, text: str) -> int | None:
    """The bytes of `text` (a reply's, or what is left of it to stream) when a stop string cut the reply,
    else None: then its tokens' entries are reported as they are (an EOS token has no text in the reply)."""
    return len(text.encode("utf-8")) if result.finish_reason == "stop" else None


def response(
    rid: str, model: str, chat: bool, result, token_text: TokenText | None = None, tools=None
) -> dict:
    """A whole (non-streamed) chat.completion or text_completion; `tools` (tools.Tools): its calls parsed."""
    calls = tools.parse(result.text) if tools is not None else None
    if calls:
        message = {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]}
        content = {"message": message}
    else:
        content = (
            {"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text}
        )
    items = getattr(result, "logprobs", None)
    lp = (
        logprobs(chat, items, token_text, byte_budget=stop_budget(result, result.text))
        if token_text and not calls
        else None
    )
    reason = finish_reason(result.finish_reason, calls)
    choice = {"index": 0, **content, "logprobs": lp, "finish_reason": reason}
    obj = "chat.completion" if chat else "text_completion"
    return _envelope(rid, model, obj, [choice], usage=usage(result))


def chunk(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    finish: str | None,
    first: bool = False,
    lp: dict | None = None,
    calls=None,
) -> dict:
    """One streamed chunk: a delta of text (chat) or a text piece (completions), with its tokens' `lp`; `calls`
    (tools.ToolCall ...): a chat delta of tool calls."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        if calls:
            delta = {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
    return _envelope(rid, model, _chunk_object(chat), [choice])


def usage_chunk(rid: str, model: str, chat: bool, result) -> dict:
    """The last streamed chunk when the client asked for usage (stream_options.include_usage)."""
    return _envelope(rid, model, _chunk_object(chat), [], usage=usage(result))


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"
