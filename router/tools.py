"""Tool calling in the Hermes format (Qwen2.5's `<tool_call>{json}</tool_call>` tags).

- Prompt: the served families' chat templates (Qwen2-VL, Qwen2.5-VL, LLaVA) have no tool
  section, so the router renders tools, assistant `tool_calls` and `role: tool` messages
  the way Qwen2.5's template does, as text in plain system / assistant / user messages,
  and the checkpoint's template is applied to those (`render_messages`).
- Forcing: `tool_choice` "required" or a named function becomes an llguidance grammar
  for exactly one `<tool_call>` block whose JSON is one of the allowed functions with its
  arguments valid against that function's `parameters` schema (`tool_choice_grammar`),
  so even a random-weight model answers with a valid call.
- Output: `parse_tool_calls` (whole text) and `ToolCallStream` (streamed pieces) turn
  the blocks back into OpenAI `tool_calls`; the text outside them is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from triptych.router.errors import InvalidRequestError
from triptych.router.protocol import ChatMessage, NamedToolChoice, TextPart, ToolDef
from triptych.router.structured import check_grammar, schema_grammar, with_defaults

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

# Qwen2.5's tool preamble (its chat template's text), appended to the system message.
_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
DEFAULT_SYSTEM = "You are a helpful assistant."


# --- request checks and the forcing grammar ----------------------------------------------


def check_tools(tools: list[ToolDef] | None, choice: str | NamedToolChoice | None) -> None:
    """400s for what OpenAI refuses: a `parameters` schema that does not compile, two tools
    of one name, a named or required choice without such a tool."""
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        if tool.function.name in names:
            raise InvalidRequestError(f"tools[{i}]: duplicate function name {tool.function.name!r}",
                                      param=f"tools[{i}].function.name")
        names.add(tool.function.name)
        schema_grammar(_parameters(tool), f"tools[{i}].function.parameters")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                                  param="tool_choice")
    if choice == "required" and not names:
        raise InvalidRequestError("tool_choice 'required' needs at least one tool", param="tool_choice")


def _parameters(tool: ToolDef) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params is not None else {"type": "object", "properties": {}}


def tool_choice_grammar(tools: list[ToolDef] | None, choice: str | NamedToolChoice | None) -> str | None:
    """The grammar forcing one call for "required" / a named function; None otherwise."""
    if choice == "required":
        allowed = list(tools or [])
    elif isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools or [] if t.function.name == choice.function.name]
    else:
        return None
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)}}
               for t in allowed]
    schema = with_defaults(options[0] if len(options) == 1 else {"anyOf": options})
    lark = ("%llguidance {}\n"
            f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")
    return check_grammar(lark, "tools", "the tool call grammar")


# --- the prompt ----------------------------------------------------------------------------


def _tools_text(tools: list[ToolDef]) -> str:
    lines = [json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools]
    return _PREAMBLE + "".join("\n" + line for line in lines) + _POSTAMBLE


def _call_text(call: Any) -> str:
    try:  # arguments arrive as a JSON string; Qwen's template writes them as a JSON object
        args: Any = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _text_of(msg: ChatMessage, index: int) -> str:
    """The text of a message rendered as Hermes text (images would be lost: a 400)."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    for j, part in enumerate(msg.content):
        if not isinstance(part, TextPart):
            raise InvalidRequestError(f"messages[{index}]: a {msg.role} message rendered with tools may hold "
                                      "text parts only", param=f"messages[{index}].content[{j}]")
    return "".join(p.text for p in msg.content if isinstance(p, TextPart))


def render_messages(messages: list[ChatMessage], tools: list[ToolDef] | None) -> list[ChatMessage]:
    """Messages with tools, tool calls and tool results written as Hermes text (roles
    system / user / assistant only), ready for the checkpoint's chat template."""
    if not tools and not any(m.role == "tool" or m.tool_calls for m in messages):
        return messages
    out: list[ChatMessage] = []
    start = 0
    if tools:
        first = messages[0]
        if first.role in ("system", "developer"):
            sys_text = _text_of(first, 0) + "\n\n" + _tools_text(tools)
            start = 1
        else:
            sys_text = DEFAULT_SYSTEM + "\n\n" + _tools_text(tools)
        out.append(ChatMessage(role="system", content=sys_text))
    responses: list[str] = []
    for i, msg in enumerate(messages[start:], start):
        if msg.role == "tool":  # consecutive results go in one user turn, as Qwen2.5 does
            responses.append(f"<tool_response>\n{_text_of(msg, i)}\n</tool_response>")
            continue
        if responses:
            out.append(ChatMessage(role="user", content="\n".join(responses)))
            responses = []
        if msg.role == "assistant" and msg.tool_calls:
            text = _text_of(msg, i)
            parts = ([text] if text else []) + [_call_text(c) for c in msg.tool_calls]
            out.append(ChatMessage(role="assistant", content="\n".join(parts)))
        else:
            out.append(msg)
    if responses:
        out.append(ChatMessage(role="user", content="\n".join(responses)))
    return out


# --- the output ----------------------------------------------------------------------------


def _call(block: str, index: int) -> dict[str, Any] | None:
    """One `<tool_call>` body -> an OpenAI tool call (None when it is not a call)."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole completion; content is None when only calls remain."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), len(calls))
        if call is None:
            continue  # not a call: it stays in the content
        content.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    content.append(text[pos:])
    joined = "".join(content)
    if calls:
        joined = joined.strip()
    return (joined or None) if calls else text, calls


@dataclass
class ToolCallStream:
    """Streamed text -> (content delta, completed tool calls). Text that may be the start
    of a `<tool_call>` tag, or is inside one, is held back until the block closes; each
    closed block becomes one tool-call delta (name and whole arguments). Whitespace is
    held until content that is not whitespace follows (none is sent around calls)."""

    _held: str = ""
    _ws: str = ""  # whitespace waiting for content
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += piece
        content: list[str] = []
        new: list[dict[str, Any]] = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                break
            end = self._held.find(CLOSE, start)
            if end < 0:
                content.append(self._emit(self._held[:start]))
                self._held = self._held[start:]
                return "".join(content), new
            call = _call(self._held[start + len(OPEN):end], len(self.calls))
            if call is None:  # not a call: its text is content
                content.append(self._emit(self._held[:end + len(CLOSE)]))
            else:
                content.append(self._emit(self._held[:start]))
                self.calls.append(call)
                new.append(call)
            self._held = self._held[end + len(CLOSE):]
        keep = _partial_tag(self._held)
        cut = len(self._held) - keep
        content.append(self._emit(self._held[:cut]))
        self._held = self._held[cut:]
        return "".join(content), new

    def _emit(self, text: str) -> str:
        """`text` unless it is only whitespace (then it waits for more)."""
        if not text.strip():
            self._ws += text
            return ""
        out, self._ws = self._ws + text, ""
        return out

    def finish(self) -> str:
        """What is left at the end (an unclosed tag is content)."""
        rest, self._held = self._held, ""
        text = self._emit(rest) if rest.strip() else ""
        if not self.calls and not text:
            text = self._ws
        self._ws = ""
        return text


def _partial_tag(text: str) -> int:
    """The length of the longest suffix of `text` that is a prefix of `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
