"""OpenAI-compatible request and response schemas (pydantic), and their mapping to SamplingParams.

Field ranges are checked here, so a bad value is a 400 naming the field before the engine sees it.
Unknown top-level fields are ignored, as OpenAI-compatible servers do, and named in the response's
``X-Ignored-Fields`` header. ``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``structured_outputs``, ``guided_*`` and ``priority`` are
extensions (vLLM's names); ``ttft_deadline_ms`` is ours.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mcp2026.serve.protocol_structured import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsField,
    ToolCall,
    ToolDefinition,
    constraint_of,
)
from mcp2026.types import MAX_LOGIT_BIAS_TOKENS, SamplingParams, StructuredOutputs

MAX_TOKENS_LIMIT = 1 << 20
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
TokenIds = list[Annotated[int, Field(ge=0, lt=1 << 31)]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Fields of neither are kept aside (``ignored_fields``): the response
    names them in ``X-Ignored-Fields`` and the log says so, rather than dropping them unseen."""

    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        """The unknown fields' names, as far as they are safe to echo in a header (others: ``?``)."""
        return sorted({k if _SAFE_NAME.fullmatch(k) else "?" for k in self.model_extra or ()})

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    best_of: int | None = Field(None, ge=1, le=128)  # generate this many, return the n most likely
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # isolates prefix-cache reuse
    priority: int = Field(0, ge=0, le=1000)  # added to the tenant's priority; higher runs later
    ttft_deadline_ms: float | None = Field(
        None, gt=0, le=3.6e6
    )  # first token wanted within (deadline policy)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return None
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(value)}")
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids written as decimal strings, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> _SamplingFields:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of above n cannot be streamed (the best are known only at the end)")
        return self

    @property
    def num_generated(self) -> int:
        """Sequences generated per prompt: ``best_of`` when it asks for more than ``n``."""
        return max(self.n, self.best_of or 1)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def structured_spec(self) -> tuple[StructuredOutputs | None, str | None]:
        """The request's constraint and the field that set it; a 400 when two fields set one."""
        found: list[tuple[StructuredOutputs, str]] = []
        so = self.structured_outputs
        if so is not None:
            fields = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex}
            fields |= {"choice": so.choice, "grammar": so.grammar}
            fields = {k: v for k, v in fields.items() if v is not None}
            if len(fields) != 1:
                raise ValueError(
                    "structured_outputs takes exactly one of json, json_object, regex, choice, grammar"
                )
            ((key, value),) = fields.items()
            found.append((constraint_of(key, value), "structured_outputs"))
        for key in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{key}")
            if value is not None:
                found.append((constraint_of(key, value), f"guided_{key}"))
        found += self._response_format_spec()
        if len(found) > 1:
            names = ", ".join(name for _, name in found)
            raise ValueError(f"give one structured output constraint, got {names}")
        if found and (self.ignore_eos or self.min_tokens):
            raise ValueError(f"{found[0][1]} cannot be combined with ignore_eos or min_tokens")
        return found[0] if found else (None, None)

    def _response_format_spec(self) -> list[tuple[StructuredOutputs, str]]:
        spec = self.response_format.spec() if self.response_format is not None else None
        return [(spec, "response_format")] if spec is not None else []

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        structured: StructuredOutputs | None = None,
    ) -> SamplingParams:
        """The engine's parameters for choice ``choice`` of this request (seeds differ per choice)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=None if self.seed is None else (self.seed + choice) % (1 << 63),
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            min_tokens=min(self.min_tokens, max_tokens),
            structured_outputs=structured,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            prompt_logprobs=self.prompt_logprobs,
        )

    @property
    def prompt_logprobs(self) -> int | None:
        """Top-n logprobs wanted for each prompt token (completions' echo with logprobs); None: none."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        if isinstance(value, list) and any(isinstance(p, list) and not p for p in value):
            raise ValueError("a token-id prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("suffix is not supported")
        return None

    @property
    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one string, a list of strings, one id list or a list of id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this is the result of

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools"
                )
        elif self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses ----------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeRequest(BaseModel):
    """``/tokenize``: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mcp2026"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
