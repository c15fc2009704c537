"""OpenAI-compatible request and response models (the subset Triptych serves).

Unknown fields are refused (extra="forbid") and fields whose values would change the
result but which we do not implement are refused by `unsupported_fields()`: a client
must never get a silently different answer than it asked for.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- content parts -------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, ignored (as vLLM)


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        # Some clients send "image_url": "<url>" instead of {"url": "<url>"}.
        return {"url": value} if isinstance(value, str) else value


class VideoURL(_Strict):
    url: str  # data:video/...;base64,... or http(s) (same allow-list as images)


class VideoPart(_Strict):
    """A video (vLLM's `video_url` part): sampled and sized by the request's `mm_processor_kwargs`."""

    type: Literal["video_url"]
    video_url: VideoURL

    @field_validator("video_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


# --- tools (router/tools.py) ----------------------------------------------------------


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; one that does not compile is a 400
    strict: bool | None = None  # calls are grammar-forced to the schema either way


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, unused
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages (the Hermes format does not use it)
    refusal: str | None = None  # accepted, unused (clients echo assistant messages back)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and self.role == "assistant" and self.tool_calls:
            self.content = ""
        return self


# --- requests --------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the grammar gives exactly the schema either way


class ResponseFormat(_Strict):
    """`text`, `json_object` or `json_schema` (router/structured.py compiles the grammar)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class _SamplingFields(_Strict):
    """Fields both endpoints share. Ranges are SamplingParams' (a 400 names the field)."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send every field, unset ones as null ("n": null, "stream": null).
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].default is None}
        return data

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extra; -1 and 0 both mean off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    ignore_eos: bool = False  # vLLM extra
    min_tokens: int = 0  # vLLM extra; only 0 is supported
    skip_special_tokens: bool = True  # vLLM extra
    return_token_ids: bool = False  # vLLM extra: each choice carries the generated token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None  # accepted, unused
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extra
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    use_beam_search: bool = False  # vLLM extra

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to a value we do not implement."""
        out: list[tuple[str, str]] = []
        if self.n != 1:
            out.append(("n", "only n=1 is supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is supported"))
        if self.use_beam_search:
            out.append(("use_beam_search", "beam search is not supported"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                out.append((name, f"{name} is not supported (only 0)"))
        if self.repetition_penalty != 1.0:
            out.append(("repetition_penalty", "repetition_penalty is not supported (only 1)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        if self.min_tokens != 0:
            out.append(("min_tokens", "min_tokens is not supported (only 0)"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed when stream is true"))
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's per-request processor options; for videos: fps (default 2), num_frames,
    # min_frames, max_frames, min_pixels, max_pixels (router/videos.py checks the keys).
    mm_processor_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # harmless without tools
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None  # accepted, unused
    metadata: dict[str, str] | None = None  # accepted, unused
    service_tier: str | None = None  # accepted, unused

    def unsupported_fields(self) -> list[tuple[str, str]]:
        out = super().unsupported_fields()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported yet"))
        if self.functions:
            out.append(("functions", "the deprecated functions field is not supported; use tools"))
        if self.function_call not in (None, "none"):
            out.append(("function_call", "the deprecated function_call field is not supported; use tool_choice"))
        if self.tools and self.response_format is not None and self.response_format.type != "text" \
                and self.tool_choice not in (None, "none", "auto"):
            out.append(("response_format", "response_format cannot be combined with a forced tool_choice"))
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            out.append(("modalities", "only the 'text' output modality is supported"))
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported"))
        return out

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens in OpenAI's API.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    response_format: ResponseFormat | None = None  # vLLM extra: structured output for completions

    def unsupported_fields(self) -> list[tuple[str, str]]:
        out = super().unsupported_fields()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported yet"))
        return out


# --- responses -------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    """A streamed tool call: index, id, type and the function's name and arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """Streamed as `data: <json>`; `usage` is present only with include_usage."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triptych"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
