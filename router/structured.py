"""Structured output: OpenAI's `response_format`, and vLLM's `structured_outputs` and
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, -> an llguidance grammar.

The grammar is compiled and checked here, before any stage runs (a schema llguidance
cannot compile is a 400 that names the field), then carried to every instance that
samples for the request (`StageRequest.grammar`; worker/engine/guided.py applies it).

JSON is generated compact by default (no free whitespace between tokens: a model,
random-weight ones above all, could otherwise spend max_tokens on blanks); a schema's own
`x-guidance` options override that, as in llguidance.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from triptych.router.errors import InvalidRequestError

# llguidance's JSON compile options (JsonCompileOptions) Triptych applies unless a schema's
# `x-guidance` says otherwise.
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


def check_grammar(grammar: str, param: str, what: str) -> str:
    """`grammar` if llguidance compiles it, else a 400 naming `param`."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"{param}: {what} cannot be compiled: {error}", param=param,
                                  code="invalid_schema")
    return grammar


def schema_grammar(schema: Any, param: str) -> str:
    """A grammar for JSON values valid against `schema` (a JSON Schema object)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param, code="invalid_schema")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{param}: the JSON schema cannot be compiled: {exc}", param=param,
                                  code="invalid_schema") from None
    return check_grammar(grammar, param, "the JSON schema")


def with_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with Triptych's JSON options as its `x-guidance` (its own keys win), for
    grammars that embed a schema (`%json` in Lark) where compile defaults do not reach."""
    return {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar of a request's `response_format` (None for text / absent)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return schema_grammar({"type": "object"}, "response_format")
    spec = response_format.json_schema
    assert spec is not None  # the protocol model requires it for type json_schema
    # OpenAI's `strict` asks for exactly the schema; a grammar gives that in every case.
    return schema_grammar(spec.schema_ if spec.schema_ is not None else {}, "response_format.json_schema.schema")


def choice_grammar(choices: list[str]) -> str:
    """A grammar for exactly one of `choices` (vLLM's guided_choice)."""
    # JSON string syntax is Lark's string-literal syntax in llguidance: any text is quoted exactly.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _json_grammar(value: Any, param: str) -> str:
    """vLLM accepts a JSON Schema as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: not valid JSON: {exc}", param=param, code="invalid_schema") from None
    return schema_grammar(value, param)


def _compiled(kind: str, value: Any, param: str) -> str:
    if kind == "json":
        return _json_grammar(value, param)
    if kind == "json_object":
        return schema_grammar({"type": "object"}, param)
    if kind == "choice":
        return check_grammar(choice_grammar(value), param, "the choices")
    if kind == "regex":
        return check_grammar(llguidance.LLMatcher.grammar_from_regex(value), param, "the regex")
    return check_grammar(llguidance.LLMatcher.grammar_from_lark(value), param, "the Lark grammar")


def vllm_guided_grammar(body: Any) -> tuple[str, str] | None:
    """(grammar, param) of vLLM's guided decoding fields — `structured_outputs` or the
    older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` — or None
    when none is set. More than one constraint is a 400 (vLLM's rule too)."""
    given: list[tuple[str, Any, str]] = []
    so = body.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("json_object", so.json_object or None)):
            if value is not None:
                given.append((kind, value, f"structured_outputs.{kind}"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            given.append((kind, value, f"guided_{kind}"))
    if not given:
        if so is not None:
            raise InvalidRequestError("structured_outputs: set one of json, regex, choice, grammar or json_object",
                                      param="structured_outputs")
        return None
    if len(given) > 1:
        names = ", ".join(p for _, _, p in given)
        raise InvalidRequestError(f"only one kind of structured output per request; got {names}",
                                  param=given[1][2], code="unsupported_parameter")
    kind, value, param = given[0]
    return _compiled(kind, value, param), param


def request_grammar(body: Any, forced_tool: str | None = None) -> str | None:
    """The one grammar of a chat or completion request: a forced tool call (chat),
    `response_format`, or vLLM's guided decoding fields; two of them is a 400."""
    guided = vllm_guided_grammar(body)
    fmt = response_format_grammar(body.response_format)
    if guided is not None and (fmt is not None or forced_tool is not None):
        other = "response_format" if fmt is not None else "tool_choice"
        raise InvalidRequestError(f"{guided[1]} cannot be combined with {other}", param=guided[1],
                                  code="unsupported_parameter")
    return forced_tool or fmt or (guided[0] if guided else None)
