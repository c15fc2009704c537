"""Structured output: OpenAI's `response_format` -> an llguidance grammar.

The grammar is compiled and checked here, before any stage runs (a schema llguidance
cannot compile is a 400 that names the field), then carried to every instance that
samples for the request (`StageRequest.grammar`; worker/engine/guided.py applies it).

JSON is generated compact by default (no free whitespace between tokens: a model,
random-weight ones above all, could otherwise spend max_tokens on blanks); a schema's own
`x-guidance` options override that, as in llguidance.
"""

from __future__ import annotations

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
