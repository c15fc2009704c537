"""OpenAI-compatible request models (the subset Triptych serves; the response bodies are
in responses.py).

Unknown top-level request fields are ignored and logged, as vLLM does (its
OpenAIBaseModel: "fields were present in the request but ignored"), so clients written
for other servers work unchanged; inside messages, content parts and stream_options an
unknown key is a 400 (a typo there changes what the prompt is). Known fields whose values
would change the result but which we do not implement are refused by
`unsupported_fields()`: a client never gets a silently different answer for a field we
know.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from triptych.sampling_params import MAX_TOP_LOGPROBS

log = logging.getLogger("triptych.router.protocol")

MAX_N = 16  # choices (n or best_of) per request: each holds its own KV cache while it decodes

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


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (its guided decoding): exactly one constraint
    (router/structured.py compiles it, as `response_format`'s)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # Lark (llguidance's dialect)
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # compact JSON is the default here already
    disable_fallback: bool | None = None  # one backend: nothing to fall back to

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Ranges are SamplingParams' (a 400 names the field)."""

    model_config = ConfigDict(extra="ignore")  # vLLM's behaviour; logged in _null_means_default

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Many clients send every field, unset ones as null ("n": null, "stream": null).
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                log.warning("fields present in the request but ignored: %s", ", ".join(map(str, unknown)))
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
    min_tokens: int = 0  # vLLM extra: EOS and stop tokens held back until this many tokens
    min_p: float | None = None  # vLLM extra
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # vLLM extra: keep the prompt's last k tokens
    skip_special_tokens: bool = True  # vLLM extra
    return_token_ids: bool = False  # vLLM extra: each choice carries the generated token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    user: str | None = None  # accepted, unused
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extra
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # vLLM: generate best_of, return the n likeliest
    use_beam_search: bool = False  # vLLM extra
    include_stop_str_in_output: bool = False  # vLLM extra: the stop string that ended a choice stays in its text
    return_tokens_as_token_ids: bool = False  # vLLM extra: log-prob tokens spelled "token_id:<id>"
    # vLLM's guided decoding: `structured_outputs` today, the guided_* fields in older
    # releases; at most one constraint per request (router/structured.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, unused: llguidance is the one backend
    # vLLM extras we know but do not implement: refused when set (unsupported_fields).
    guided_whitespace_pattern: str | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None

    @property
    def num_sequences(self) -> int:
        """How many sequences the backend generates (best_of when set, else n)."""
        return self.best_of if self.best_of is not None else self.n

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) for every field set to a value we do not implement."""
        out: list[tuple[str, str]] = []
        if self.best_of is not None and self.best_of < self.n:
            out.append(("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"))
        if self.best_of is not None and self.best_of > self.n and self.stream:
            out.append(("best_of", "best_of greater than n cannot be streamed"))
        if self.use_beam_search:
            out.append(("use_beam_search", "beam search is not supported"))
        if self.logit_bias:
            for key in self.logit_bias:
                if not key.lstrip("-").isdigit():
                    out.append(("logit_bias", f"logit_bias keys must be token ids; got {key!r}"))
                    break
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed when stream is true"))
        for name in ("guided_whitespace_pattern", "prompt_logprobs", "allowed_token_ids", "bad_words",
                     "logits_processors"):
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported"))
        return out


def continue_final_message_error(messages: list[ChatMessage], continue_final_message: bool,
                                 add_generation_prompt: bool) -> str | None:
    """Why `continue_final_message` cannot apply to `messages` (chat and /tokenize); None
    when it can, or is not asked for."""
    if not continue_final_message:
        return None
    if add_generation_prompt:
        return "continue_final_message needs add_generation_prompt set to false (the reply continues the last message)"
    if not messages or messages[-1].role != "assistant":
        return "continue_final_message needs an assistant message last"
    return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's per-request processor options; for videos: fps (default 2), num_frames,
    # min_frames, max_frames, min_pixels, max_pixels (router/videos.py checks the keys).
    mm_processor_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: passed to the chat template
    add_generation_prompt: bool = True  # vLLM extra: end the prompt with the assistant's turn header
    continue_final_message: bool = False  # vLLM extra: the reply continues the last message's text
    echo: bool = False  # vLLM extra: the last message's text (when it is the reply's role) opens the reply
    chat_template: str | None = None  # vLLM extra, refused: the checkpoint's template is the one served
    documents: list[dict[str, str]] | None = None  # vLLM extra, refused (no RAG template here)
    media_io_kwargs: dict[str, Any] | None = None  # vLLM extra, refused (use mm_processor_kwargs)
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
        if self.top_logprobs and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs set to true"))
        if self.functions:
            out.append(("functions", "the deprecated functions field is not supported; use tools"))
        if self.function_call not in (None, "none"):
            out.append(("function_call", "the deprecated function_call field is not supported; use tool_choice"))
        if self.tools and self.response_format is not None and self.response_format.type != "text" \
                and self.tool_choice not in (None, "none", "auto"):
            out.append(("response_format", "response_format cannot be combined with a forced tool_choice"))
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            out.append(("modalities", "only the 'text' output modality is supported"))
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "chat_template",
                     "documents", "media_io_kwargs"):
            if getattr(self, name) is not None:
                out.append((name, f"{name} is not supported"))
        if why := continue_final_message_error(self.messages, self.continue_final_message,
                                               self.add_generation_prompt):
            out.append(("continue_final_message", why))
        return out

    @property
    def echo_text(self) -> str:
        """What `echo` puts before each choice's content (vLLM's rule): the last message's
        text when it has the reply's role (assistant, or the last message's own role when no
        generation prompt is added), else nothing."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        if not self.echo or last.role != role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(part.text for part in last.content if isinstance(part, TextPart))

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens in OpenAI's API.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for this endpoint
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None  # vLLM extra: structured output for completions

    def unsupported_fields(self) -> list[tuple[str, str]]:
        out = super().unsupported_fields()
        if self.echo and self.logprobs is not None:
            out.append(("echo", "echo with logprobs needs the prompt's log-probs, which are not computed"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out
